// The AVX512 intrinsics our kernels use (kquants_vnni.cpp, kquants_common.h, layer_ops.cpp), for
// CPUs with AVX2, FMA and F16C only (AMD Zen 1-3, Intel before Skylake-X and most of its client
// chips): each 512-bit vector is two 256-bit halves and each operation runs on both; a 16-bit
// mask is two 8-lane masks. Every operation is the same arithmetic lane by lane (the same integer
// dots, the same rounding of each float operation), so this build gives a row the bits the
// AVX512 build gives it: one model, one answer, whichever kernel ran. Included (with
// -DSPECWOOD_AVX2) after <immintrin.h>: the names below then stand for these functions in the
// kernel's source.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace avx2 {

struct v16f {
  __m256 lo, hi;
};
struct v16i {
  __m256i lo, hi;
};
struct v8d {
  __m256d lo, hi;
};

inline v16f setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline v16i setzero_si() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline v16f set1_ps(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline v16i set1_epi32(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline v16i set1_epi8(char v) { return {_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; }
inline v16f loadu_ps(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storeu_ps(float* p, v16f v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline v16i loadu_si(const void* p) {
  const __m256i* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}

#define SPECWOOD_PAIR_F(name, op) \
  inline v16f name(v16f a, v16f b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
#define SPECWOOD_PAIR_I(name, op) \
  inline v16i name(v16i a, v16i b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
SPECWOOD_PAIR_F(mul_ps, _mm256_mul_ps)
SPECWOOD_PAIR_F(add_ps, _mm256_add_ps)
SPECWOOD_PAIR_F(sub_ps, _mm256_sub_ps)
SPECWOOD_PAIR_F(div_ps, _mm256_div_ps)
SPECWOOD_PAIR_F(unpacklo_ps, _mm256_unpacklo_ps)  // within 128-bit quarters, as the 512-bit ones
SPECWOOD_PAIR_F(unpackhi_ps, _mm256_unpackhi_ps)
SPECWOOD_PAIR_I(add_epi32, _mm256_add_epi32)
SPECWOOD_PAIR_F(max_ps, _mm256_max_ps)
SPECWOOD_PAIR_F(min_ps, _mm256_min_ps)
SPECWOOD_PAIR_I(and_si, _mm256_and_si256)
SPECWOOD_PAIR_I(or_si, _mm256_or_si256)
SPECWOOD_PAIR_I(sub_epi32, _mm256_sub_epi32)
#undef SPECWOOD_PAIR_F
#undef SPECWOOD_PAIR_I

inline v16f operator-(v16f a) {  // the sign flipped, as GCC's vector negation does
  const __m256 sign = _mm256_set1_ps(-0.f);
  return {_mm256_xor_ps(a.lo, sign), _mm256_xor_ps(a.hi, sign)};
}
inline v16f fmadd_ps(v16f a, v16f b, v16f c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline v16f fnmadd_ps(v16f a, v16f b, v16f c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline v16f abs_ps(v16f a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}
inline v16i srli_epi16(v16i a, int n) { return {_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }
inline v16i slli_epi16(v16i a, int n) { return {_mm256_slli_epi16(a.lo, n), _mm256_slli_epi16(a.hi, n)}; }
inline v16i slli_epi32(v16i a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
inline v16f castsi_ps(v16i a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
inline v16f cvtepi32_ps(v16i a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline v16i cvtps_epi32(v16f a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline v16f cvtph_ps(__m256i h) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
inline v16i cvtepu16_epi32(__m256i v) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1))};
}
inline v16i cvtepu8_epi32(__m128i v) { return {_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))}; }
inline v16i cvtepi8_epi32(__m128i v) { return {_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))}; }

// int32 lanes to int8 with signed saturation, in lane order.
inline __m128i cvtsepi32_epi8(v16i a) {
  const __m256i words = _mm256_packs_epi32(a.lo, a.hi);  // per 128-bit half: lo[0:4] hi[0:4] | lo[4:8] hi[4:8]
  const __m128i w0 = _mm256_castsi256_si128(words), w1 = _mm256_extracti128_si256(words, 1);
  const __m128i bytes = _mm_packs_epi16(w0, w1);  // lo[0:4] hi[0:4] lo[4:8] hi[4:8]
  return _mm_shuffle_epi32(bytes, _MM_SHUFFLE(3, 1, 2, 0));  // lo[0:4] lo[4:8] hi[0:4] hi[4:8]
}

inline float reduce_max_ps(v16f a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}
inline int32_t reduce_add_epi32(v16i a) {  // exact: integers
  __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(h);
}

// vpdpbusd: each int32 lane plus the sum of its four unsigned-by-signed byte products, exactly.
// The bytes are split into their even and odd 16-bit halves so that vpmaddwd sums the products
// in int32 (vpmaddubsw would sum pairs in int16 and saturate for codes above 128, as Q8_0's are).
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
  const __m256i even_mask = _mm256_set1_epi16(0x00ff);
  const __m256i ue = _mm256_and_si256(u, even_mask), uo = _mm256_srli_epi16(u, 8);
  const __m256i se = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), so = _mm256_srai_epi16(s, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ue, se), _mm256_madd_epi16(uo, so)));
}
inline v16i dpbusd_epi32(v16i acc, v16i u, v16i s) { return {dpbusd256(acc.lo, u.lo, s.lo), dpbusd256(acc.hi, u.hi, s.hi)}; }

// The same where the unsigned bytes are below 128 (the k-quants' codes: at most 63) and the signed
// ones above -128 (the activations: -127..127): two products then sum to at most 2 * 127 * 127 in
// magnitude, so vpmaddubsw's int16 sums are exact, and vpmaddwd by ones adds the pairs in int32.
inline __m256i dpbusd_small256(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline v16i dpbusd_small(v16i acc, v16i u, v16i s) {
  return {dpbusd_small256(acc.lo, u.lo, s.lo), dpbusd_small256(acc.hi, u.hi, s.hi)};
}

// Masks of 64 bytes: one bit a byte. maskz_mov_epi8(m, v): v's byte where m's bit is set, else 0.
inline uint64_t cvtu64_mask64(uint64_t m) { return m; }
inline __m256i byte_mask32(uint32_t bits) {
  // byte i takes bit i: broadcast the 4 mask bytes, byte i its mask byte i / 8, then test bit i % 8
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)),
                                             _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                                                0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}
inline v16i maskz_mov_epi8(uint64_t m, v16i v) {
  return {_mm256_and_si256(byte_mask32(static_cast<uint32_t>(m)), v.lo),
          _mm256_and_si256(byte_mask32(static_cast<uint32_t>(m >> 32)), v.hi)};
}

// --- for layer_ops.cpp ---------------------------------------------------------------------------

inline v16i srli_epi32(v16i a, int n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
inline v16i castps_si(v16f a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
inline v8d castps_pd(v16f a) { return {_mm256_castps_pd(a.lo), _mm256_castps_pd(a.hi)}; }
inline v16f castpd_ps(v8d a) { return {_mm256_castpd_ps(a.lo), _mm256_castpd_ps(a.hi)}; }
inline v8d unpacklo_pd(v8d a, v8d b) { return {_mm256_unpacklo_pd(a.lo, b.lo), _mm256_unpacklo_pd(a.hi, b.hi)}; }
inline v8d unpackhi_pd(v8d a, v8d b) { return {_mm256_unpackhi_pd(a.lo, b.lo), _mm256_unpackhi_pd(a.hi, b.hi)}; }
inline __m256 castps512_ps256(v16f a) { return a.lo; }
inline __m256d extractf64x4_pd(v8d a, int upper) { return upper ? a.hi : a.lo; }
inline void storeu_si(void* p, v16i v) {
  __m256i* q = reinterpret_cast<__m256i*>(p);
  _mm256_storeu_si256(q, v.lo);
  _mm256_storeu_si256(q + 1, v.hi);
}
inline v16i setr_epi32(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7, int a8, int a9, int a10,
                       int a11, int a12, int a13, int a14, int a15) {
  return {_mm256_setr_epi32(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_setr_epi32(a8, a9, a10, a11, a12, a13, a14, a15)};
}

// 128-bit quarters: [a's quarter IMM bits 0-1, a's bits 2-3, b's bits 4-5, b's bits 6-7]; a 256-bit
// half holds quarters 0-1 (lo) and 2-3 (hi), which are vperm2f128's selectors 0-3 over (lo, hi).
template <int IMM>
inline v16f shuffle_f32x4(v16f a, v16f b) {
  return {_mm256_permute2f128_ps(a.lo, a.hi, (IMM & 3) | ((IMM >> 2) & 3) << 4),
          _mm256_permute2f128_ps(b.lo, b.hi, ((IMM >> 4) & 3) | ((IMM >> 6) & 3) << 4)};
}

// 16 lanes to 16 bits: each int32 lane's low half, in lane order (vpmovdw). Masked to 16 bits
// first so that the unsigned saturation of vpackusdw never applies.
inline __m256i cvtepi32_epi16(v16i a) {
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  const __m256i packed = _mm256_packus_epi32(_mm256_and_si256(a.lo, low), _mm256_and_si256(a.hi, low));
  return _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0));  // lo[0:4] hi[0:4] lo[4:8] hi[4:8] -> lane order
}

template <int PREDICATE>
inline __mmask16 cmp_ps_mask(v16f a, v16f b) {
  return static_cast<__mmask16>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, PREDICATE)) |
                                _mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, PREDICATE)) << 8);
}
// vrndscaleps with scale 0 is vroundps: the same rounding-control bits.
template <int IMM>
inline v16f roundscale_ps(v16f a) {
  static_assert((IMM & 0xF0) == 0, "only scale 0 (rounding to an integer)");
  return {_mm256_round_ps(a.lo, IMM), _mm256_round_ps(a.hi, IMM)};
}
// a * 2^n for integral n in [-126, 127], as exp16 passes: 2^n is then a normal float and the
// product is rounded once, as vscalefps rounds it.
inline v16f scalef_ps(v16f a, v16f n) {
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.lo), bias), 23));
  const __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.hi), bias), 23));
  return {_mm256_mul_ps(a.lo, lo), _mm256_mul_ps(a.hi, hi)};
}

// A 16-bit lane mask as two 8-lane vector masks (all ones where the bit is set).
inline __m256i lane_mask8(unsigned bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits & 0xFF)), bit), bit);
}
inline v16f maskz_mov_ps(__mmask16 m, v16f a) {
  return {_mm256_and_ps(_mm256_castsi256_ps(lane_mask8(m)), a.lo), _mm256_and_ps(_mm256_castsi256_ps(lane_mask8(m >> 8)), a.hi)};
}
// Masked loads and stores never touch the memory of a lane whose bit is clear (vmaskmovps), as
// AVX512's do: a row's tail may end a buffer.
inline v16f maskz_loadu_ps(__mmask16 m, const float* p) {
  return {_mm256_maskload_ps(p, lane_mask8(m)), _mm256_maskload_ps(p + 8, lane_mask8(m >> 8))};
}
inline v16f mask_loadu_ps(v16f src, __mmask16 m, const float* p) {
  const __m256i lo = lane_mask8(m), hi = lane_mask8(m >> 8);
  return {_mm256_blendv_ps(src.lo, _mm256_maskload_ps(p, lo), _mm256_castsi256_ps(lo)),
          _mm256_blendv_ps(src.hi, _mm256_maskload_ps(p + 8, hi), _mm256_castsi256_ps(hi))};
}
inline void mask_storeu_ps(float* p, __mmask16 m, v16f a) {
  _mm256_maskstore_ps(p, lane_mask8(m), a.lo);
  _mm256_maskstore_ps(p + 8, lane_mask8(m >> 8), a.hi);
}
// 16-bit lanes (bf16): AVX2 has no masked 16-bit move, so a partial mask goes lane by lane.
inline __m256i maskz_loadu_epi16(__mmask16 m, const void* p) {
  if (m == 0xFFFF) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) uint16_t lanes[16] = {};
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) lanes[i] = static_cast<const uint16_t*>(p)[i];
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
}
inline void mask_storeu_epi16(void* p, __mmask16 m, __m256i a) {
  if (m == 0xFFFF) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a);
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) static_cast<uint16_t*>(p)[i] = lanes[i];
}
// The lanes whose bits are set, packed to the front in lane order, the rest zero (vpcompressd).
template <typename V, typename E>
inline V compress(__mmask16 m, V a) {
  alignas(32) E in[16], out[16] = {};
  std::memcpy(in, &a, sizeof(in));
  int n = 0;
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) out[n++] = in[i];
  V r;
  std::memcpy(&r, out, sizeof(out));
  return r;
}
inline v16i maskz_compress_epi32(__mmask16 m, v16i a) { return compress<v16i, int32_t>(m, a); }
inline v16f maskz_compress_ps(__mmask16 m, v16f a) { return compress<v16f, float>(m, a); }

}  // namespace avx2

// The kernel's source names, from here on these functions.
#undef __m512
#define __m512 avx2::v16f
#undef __m512i
#define __m512i avx2::v16i
#undef _mm512_setzero_ps
#define _mm512_setzero_ps avx2::setzero_ps
#undef _mm512_setzero_si512
#define _mm512_setzero_si512 avx2::setzero_si
#undef _mm512_set1_ps
#define _mm512_set1_ps avx2::set1_ps
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 avx2::set1_epi32
#undef _mm512_set1_epi8
#define _mm512_set1_epi8 avx2::set1_epi8
#undef _mm512_loadu_ps
#define _mm512_loadu_ps avx2::loadu_ps
#undef _mm512_storeu_ps
#define _mm512_storeu_ps avx2::storeu_ps
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 avx2::loadu_si
#undef _mm512_mul_ps
#define _mm512_mul_ps avx2::mul_ps
#undef _mm512_max_ps
#define _mm512_max_ps avx2::max_ps
#undef _mm512_min_ps
#define _mm512_min_ps avx2::min_ps
#undef _mm512_and_si512
#define _mm512_and_si512 avx2::and_si
#undef _mm512_or_si512
#define _mm512_or_si512 avx2::or_si
#undef _mm512_sub_epi32
#define _mm512_sub_epi32 avx2::sub_epi32
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps avx2::fmadd_ps
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps avx2::fnmadd_ps
#undef _mm512_abs_ps
#define _mm512_abs_ps avx2::abs_ps
#undef _mm512_srli_epi16
#define _mm512_srli_epi16 avx2::srli_epi16
#undef _mm512_slli_epi16
#define _mm512_slli_epi16 avx2::slli_epi16
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 avx2::slli_epi32
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps avx2::castsi_ps
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps avx2::cvtepi32_ps
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 avx2::cvtps_epi32
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps avx2::cvtph_ps
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 avx2::cvtepu16_epi32
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 avx2::cvtepu8_epi32
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 avx2::cvtepi8_epi32
#undef _mm512_cvtsepi32_epi8
#define _mm512_cvtsepi32_epi8 avx2::cvtsepi32_epi8
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps avx2::reduce_max_ps
#undef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32 avx2::reduce_add_epi32
#undef _mm512_dpbusd_epi32
#define _mm512_dpbusd_epi32 avx2::dpbusd_epi32
#undef _mm512_maskz_mov_epi8
#define _mm512_maskz_mov_epi8 avx2::maskz_mov_epi8
#undef _cvtu64_mask64
#define _cvtu64_mask64 avx2::cvtu64_mask64

#undef __m512d
#define __m512d avx2::v8d
#undef _mm512_add_ps
#define _mm512_add_ps avx2::add_ps
#undef _mm512_sub_ps
#define _mm512_sub_ps avx2::sub_ps
#undef _mm512_div_ps
#define _mm512_div_ps avx2::div_ps
#undef _mm512_unpacklo_ps
#define _mm512_unpacklo_ps avx2::unpacklo_ps
#undef _mm512_unpackhi_ps
#define _mm512_unpackhi_ps avx2::unpackhi_ps
#undef _mm512_add_epi32
#define _mm512_add_epi32 avx2::add_epi32
#undef _mm512_srli_epi32
#define _mm512_srli_epi32 avx2::srli_epi32
#undef _mm512_castps_pd
#define _mm512_castps_pd avx2::castps_pd
#undef _mm512_castpd_ps
#define _mm512_castpd_ps avx2::castpd_ps
#undef _mm512_unpacklo_pd
#define _mm512_unpacklo_pd avx2::unpacklo_pd
#undef _mm512_unpackhi_pd
#define _mm512_unpackhi_pd avx2::unpackhi_pd
#undef _mm512_castps512_ps256
#define _mm512_castps512_ps256 avx2::castps512_ps256
#undef _mm512_extractf64x4_pd
#define _mm512_extractf64x4_pd avx2::extractf64x4_pd
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 avx2::setr_epi32
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 avx2::cvtepi32_epi16
#undef _mm512_scalef_ps
#define _mm512_scalef_ps avx2::scalef_ps
#undef _mm512_maskz_mov_ps
#define _mm512_maskz_mov_ps avx2::maskz_mov_ps
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps avx2::maskz_loadu_ps
#undef _mm512_mask_loadu_ps
#define _mm512_mask_loadu_ps avx2::mask_loadu_ps
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps avx2::mask_storeu_ps
#undef _mm512_maskz_compress_epi32
#define _mm512_maskz_compress_epi32 avx2::maskz_compress_epi32
#undef _mm512_maskz_compress_ps
#define _mm512_maskz_compress_ps avx2::maskz_compress_ps
#undef _mm512_castps_si512
#define _mm512_castps_si512 avx2::castps_si
#undef _mm512_storeu_si512
#define _mm512_storeu_si512 avx2::storeu_si
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, imm) avx2::shuffle_f32x4<(imm)>(a, b)
#undef _mm512_cmp_ps_mask
#define _mm512_cmp_ps_mask(a, b, predicate) avx2::cmp_ps_mask<(predicate)>(a, b)
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps(a, imm) avx2::roundscale_ps<(imm)>(a)
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 avx2::maskz_loadu_epi16
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16 avx2::mask_storeu_epi16
