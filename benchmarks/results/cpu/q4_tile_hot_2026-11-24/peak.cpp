#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main(){
  __m512i a0=_mm512_set1_epi32(1),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0;
  __m512i u=_mm512_set1_epi8(3), v=_mm512_set1_epi8(5);
  __asm__ volatile("" : "+v"(u), "+v"(v));
  const long it=200000000;
  auto t0=std::chrono::steady_clock::now();
  for(long i=0;i<it;++i){
    a0=_mm512_dpbusd_epi32(a0,u,v);a1=_mm512_dpbusd_epi32(a1,u,v);a2=_mm512_dpbusd_epi32(a2,u,v);a3=_mm512_dpbusd_epi32(a3,u,v);
    a4=_mm512_dpbusd_epi32(a4,u,v);a5=_mm512_dpbusd_epi32(a5,u,v);a6=_mm512_dpbusd_epi32(a6,u,v);a7=_mm512_dpbusd_epi32(a7,u,v);
    a8=_mm512_dpbusd_epi32(a8,u,v);a9=_mm512_dpbusd_epi32(a9,u,v);a10=_mm512_dpbusd_epi32(a10,u,v);a11=_mm512_dpbusd_epi32(a11,u,v);
    __asm__ volatile("" : "+v"(a0),"+v"(a1),"+v"(a2),"+v"(a3),"+v"(a4),"+v"(a5),"+v"(a6),"+v"(a7),"+v"(a8),"+v"(a9),"+v"(a10),"+v"(a11));
  }
  double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count();
  printf("%.1f GMAC/s, %.2f G dpbusd/s\n", 12.0*64*it/s/1e9, 12.0*it/s/1e9);
}
