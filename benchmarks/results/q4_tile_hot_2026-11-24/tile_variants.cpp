// Throwaway harness (BENCHMARKS.md §7q): the q4 kernel's tile as in q4_vnni.cpp (v0) against a
// variant that keeps Q4_K's integer sub-block scales and minimums in integer sums and converts
// once per 256 inputs (v1), one thread, weights hot in L2 (24 blocks of 32 channels x 1536 inputs).
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <vector>
#include <cstring>
constexpr int GROUP=32, LANES=16, HALF_BYTES=256, GROUP_BYTES=512, PREFETCH=2048;
inline __m512 load_half16(const uint16_t* p){return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));}

// V0: current kernel
template<int TILE>
void v0(const uint8_t* w,const uint16_t* scales,const uint16_t* mins,int64_t groups,const int8_t* xq,const float* xs,const float* code_sums,int64_t k,float* y,int64_t n,int64_t block){
  const __m512i low=_mm512_set1_epi8(0x0F);
  __m512 acc[TILE][2];
  for(int r=0;r<TILE;++r) acc[r][0]=acc[r][1]=_mm512_setzero_ps();
  for(int64_t g=0;g<groups;++g){
    const uint8_t* wg=w+g*GROUP_BYTES;
    for(int line=0;line<GROUP_BYTES;line+=64) _mm_prefetch((const char*)(wg+PREFETCH+line),_MM_HINT_T0);
    __m512i dot[TILE][2];
    for(int r=0;r<TILE;++r) dot[r][0]=dot[r][1]=_mm512_setzero_si512();
    for(int c=0;c<4;++c){
      const __m512i pa=_mm512_loadu_si512(wg+c*64), pb=_mm512_loadu_si512(wg+HALF_BYTES+c*64);
      const __m512i loa=_mm512_and_si512(pa,low), hia=_mm512_and_si512(_mm512_srli_epi16(pa,4),low);
      const __m512i lob=_mm512_and_si512(pb,low), hib=_mm512_and_si512(_mm512_srli_epi16(pb,4),low);
      for(int r=0;r<TILE;++r){
        const int8_t* xr=xq+r*k+g*GROUP+c*8;
        const __m512i xl=_mm512_set1_epi32(*(const int32_t*)xr), xh=_mm512_set1_epi32(*(const int32_t*)(xr+4));
        dot[r][0]=_mm512_dpbusd_epi32(dot[r][0],loa,xl); dot[r][1]=_mm512_dpbusd_epi32(dot[r][1],lob,xl);
        dot[r][0]=_mm512_dpbusd_epi32(dot[r][0],hia,xh); dot[r][1]=_mm512_dpbusd_epi32(dot[r][1],hib,xh);
      }
    }
    const __m512 sca=load_half16(scales+g*2*LANES), scb=load_half16(scales+g*2*LANES+LANES);
    const __m512 mna=load_half16(mins+g*2*LANES), mnb=load_half16(mins+g*2*LANES+LANES);
    for(int r=0;r<TILE;++r){
      const __m512 sums=_mm512_set1_ps(code_sums[r*groups+g]);
      acc[r][0]=_mm512_fnmadd_ps(mna,sums,_mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][0]),sca,acc[r][0]));
      acc[r][1]=_mm512_fnmadd_ps(mnb,sums,_mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][1]),scb,acc[r][1]));
    }
  }
  for(int r=0;r<TILE;++r){ const __m512 s=_mm512_set1_ps(xs[r]);
    _mm512_storeu_ps(y+r*n+block*32,_mm512_mul_ps(acc[r][0],s)); _mm512_storeu_ps(y+r*n+block*32+16,_mm512_mul_ps(acc[r][1],s)); }
}

// V1: integer sub-block scales (8 groups = superblock): isc int32 [groups][32], imn int32 [groups][32]
// per superblock float d, dmin [groups/8][32]; code sums int32.
template<int TILE>
void v1(const uint8_t* w,const int32_t* isc,const int32_t* imn,const float* d,const float* dmin,int64_t groups,const int8_t* xq,const float* xs,const int32_t* ics,int64_t k,float* y,int64_t n,int64_t block){
  const __m512i low=_mm512_set1_epi8(0x0F);
  __m512 acc[TILE][2];
  for(int r=0;r<TILE;++r) acc[r][0]=acc[r][1]=_mm512_setzero_ps();
  for(int64_t s=0;s<groups/8;++s){
    __m512i sacc[TILE][2];
    for(int r=0;r<TILE;++r) sacc[r][0]=sacc[r][1]=_mm512_setzero_si512();
    for(int64_t g=s*8;g<s*8+8;++g){
      const uint8_t* wg=w+g*GROUP_BYTES;
      for(int line=0;line<GROUP_BYTES;line+=64) _mm_prefetch((const char*)(wg+PREFETCH+line),_MM_HINT_T0);
      __m512i dot[TILE][2];
      for(int r=0;r<TILE;++r) dot[r][0]=dot[r][1]=_mm512_setzero_si512();
      for(int c=0;c<4;++c){
        const __m512i pa=_mm512_loadu_si512(wg+c*64), pb=_mm512_loadu_si512(wg+HALF_BYTES+c*64);
        const __m512i loa=_mm512_and_si512(pa,low), hia=_mm512_and_si512(_mm512_srli_epi16(pa,4),low);
        const __m512i lob=_mm512_and_si512(pb,low), hib=_mm512_and_si512(_mm512_srli_epi16(pb,4),low);
        for(int r=0;r<TILE;++r){
          const int8_t* xr=xq+r*k+g*GROUP+c*8;
          const __m512i xl=_mm512_set1_epi32(*(const int32_t*)xr), xh=_mm512_set1_epi32(*(const int32_t*)(xr+4));
          dot[r][0]=_mm512_dpbusd_epi32(dot[r][0],loa,xl); dot[r][1]=_mm512_dpbusd_epi32(dot[r][1],lob,xl);
          dot[r][0]=_mm512_dpbusd_epi32(dot[r][0],hia,xh); dot[r][1]=_mm512_dpbusd_epi32(dot[r][1],hib,xh);
        }
      }
      const __m512i sa=_mm512_loadu_si512(isc+g*32), sb=_mm512_loadu_si512(isc+g*32+16);
      for(int r=0;r<TILE;++r){
        sacc[r][0]=_mm512_add_epi32(sacc[r][0],_mm512_mullo_epi32(dot[r][0],sa));
        sacc[r][1]=_mm512_add_epi32(sacc[r][1],_mm512_mullo_epi32(dot[r][1],sb));
      }
    }
    // mins: sum_j m_j * cs_j, per row (integer), then float once per superblock
    const __m512 da=_mm512_loadu_ps(d+s*32), db=_mm512_loadu_ps(d+s*32+16);
    const __m512 ma=_mm512_loadu_ps(dmin+s*32), mb=_mm512_loadu_ps(dmin+s*32+16);
    for(int r=0;r<TILE;++r){
      __m512i mina=_mm512_setzero_si512(), minb=_mm512_setzero_si512();
      for(int j=0;j<8;++j){ const __m512i cs=_mm512_set1_epi32(ics[r*groups+s*8+j]);
        mina=_mm512_add_epi32(mina,_mm512_mullo_epi32(_mm512_loadu_si512(imn+(s*8+j)*32),cs));
        minb=_mm512_add_epi32(minb,_mm512_mullo_epi32(_mm512_loadu_si512(imn+(s*8+j)*32+16),cs)); }
      acc[r][0]=_mm512_fnmadd_ps(ma,_mm512_cvtepi32_ps(mina),_mm512_fmadd_ps(_mm512_cvtepi32_ps(sacc[r][0]),da,acc[r][0]));
      acc[r][1]=_mm512_fnmadd_ps(mb,_mm512_cvtepi32_ps(minb),_mm512_fmadd_ps(_mm512_cvtepi32_ps(sacc[r][1]),db,acc[r][1]));
    }
  }
  for(int r=0;r<TILE;++r){ const __m512 sc=_mm512_set1_ps(xs[r]);
    _mm512_storeu_ps(y+r*n+block*32,_mm512_mul_ps(acc[r][0],sc)); _mm512_storeu_ps(y+r*n+block*32+16,_mm512_mul_ps(acc[r][1],sc)); }
}

int main(int argc,char**argv){
  const int K=1536, B=24; const int64_t groups=K/32, N=B*32;   // 24 blocks x 24 KB = 576 KB: in L2
  std::vector<uint8_t> w(B*groups*GROUP_BYTES); for(auto&x:w) x=rand();
  std::vector<uint16_t> sc(B*groups*32, 0x3c00), mn(B*groups*32, 0x3c00);
  std::vector<int32_t> isc(B*groups*32), imn(B*groups*32); for(auto&x:isc) x=rand()%64; for(auto&x:imn) x=rand()%64;
  std::vector<float> d(B*groups/8*32,0.01f), dm(B*groups/8*32,0.01f);
  const int M=8; std::vector<int8_t> xq(M*K); for(auto&x:xq) x=rand()%255-127;
  std::vector<float> xs(M,1.f), cs(M*groups,1.f); std::vector<int32_t> ics(M*groups,3);
  std::vector<float> y(M*N);
  auto t=[&](auto fn,const char* name, int rows){
    double best=1e9;
    for(int rep=0;rep<20;++rep){ auto t0=std::chrono::steady_clock::now();
      for(int it=0;it<20;++it) for(int b=0;b<B;++b) fn(b);
      double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count()/20; if(s<best) best=s; }
    printf("%s rows %d: %.1f GMAC/s\n",name,rows,double(N)*K*rows/best/1e9);
  };
  t([&](int b){v0<8>(w.data()+b*groups*GROUP_BYTES,sc.data()+b*groups*32,mn.data()+b*groups*32,groups,xq.data(),xs.data(),cs.data(),K,y.data(),N,b);},"v0",8);
  t([&](int b){v0<8>(w.data()+b*groups*GROUP_BYTES,sc.data()+b*groups*32,mn.data()+b*groups*32,groups,xq.data(),xs.data(),cs.data(),K,y.data(),N,b);},"v0",8);
  t([&](int b){v0<8>(w.data()+b*groups*GROUP_BYTES,sc.data()+b*groups*32,mn.data()+b*groups*32,groups,xq.data(),xs.data(),cs.data(),K,y.data(),N,b);},"v0",8);
  t([&](int b){v0<4>(w.data()+b*groups*GROUP_BYTES,sc.data()+b*groups*32,mn.data()+b*groups*32,groups,xq.data(),xs.data(),cs.data(),K,y.data(),N,b);},"v0",4);
  t([&](int b){v1<8>(w.data()+b*groups*GROUP_BYTES,isc.data()+b*groups*32,imn.data()+b*groups*32,d.data()+b*groups/8*32,dm.data()+b*groups/8*32,groups,xq.data(),xs.data(),ics.data(),K,y.data(),N,b);},"v1",8);
  t([&](int b){v1<4>(w.data()+b*groups*GROUP_BYTES,isc.data()+b*groups*32,imn.data()+b*groups*32,d.data()+b*groups/8*32,dm.data()+b*groups/8*32,groups,xq.data(),xs.data(),ics.data(),K,y.data(),N,b);},"v1",4);
}
