// What the k-quant kernels share (kquants_vnni.cpp, kquants_amx.cpp): the packed layouts, the
// activations' quantisation, the unpacking of a group's codes and the float epilogues. A row's
// result is the same float operations on the same exact int32 dots whichever kernel ran, so both
// kernels give a row the same bits (what keeps trees and batches lossless across the two paths).
// See kquants_vnni.cpp's head for the layouts and why they are what they are.
#pragma once
#include <torch/extension.h>
#include <immintrin.h>
#ifdef SPECWOOD_AVX2
#include "avx512_on_avx2.h"  // the same kernels on AVX2 + FMA + F16C
#endif
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int GROUP = 32;
constexpr int LANES = 16;            // output channels per 512-bit register
constexpr int HALF_BYTES = 256;      // one group of 16 channels: 16 x 32 nibbles
constexpr int GROUP_BYTES = 512;     // one group of a block of 32 channels
constexpr int SUPER = 8;             // groups per superblock (256 inputs)
constexpr int PREFETCH = 2048;       // bytes of weights ahead of the group being multiplied
constexpr int Q8_PREFETCH = 8192;    // Q8_0 reads twice Q4_K's bytes a group: further ahead (20 -> 25 GB/s)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// The activations of a call: per row and group of 32 inputs an int8 code vector and its scale
// (x ~ xs * xq, symmetric, round to nearest even, -127..127), and per 16 inputs the sum of the
// codes. The weights' offsets (Q4_K's minimum, Q6_K's -32) multiply those sums, so each group's
// integer dot is exact and the offset cancels inside each weight instead of adding the
// activations' rounding error times a large minimum.
struct Activations {
  int64_t k, groups;
  std::vector<int8_t> q;        // [M, K]
  std::vector<float> scale;     // [M, K/32]
  std::vector<int32_t> sums16;  // [M, K/16]
};

template <typename T>
void quantize_rows(const T* x, int64_t m, Activations& a) {
  const int64_t k = a.k, groups = a.groups;
  const __m512 limit = _mm512_set1_ps(127.f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const T* p = x + r * k + g * GROUP;
      const __m512 lo = load16(p), hi = load16(p + 16);
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float scale = top > 0.f ? top / 127.f : 1.f;
      const __m512 inv = _mm512_set1_ps(1.f / scale);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(lo, inv), -limit), limit));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(hi, inv), -limit), limit));
      int8_t* out = a.q.data() + r * k + g * GROUP;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(qb));
      a.scale[r * groups + g] = scale;
      a.sums16[r * 2 * groups + 2 * g] = _mm512_reduce_add_epi32(qa);
      a.sums16[r * 2 * groups + 2 * g + 1] = _mm512_reduce_add_epi32(qb);
    }
  }
}

// row_multiple: the codes get zero rows up to a multiple of it (a tile kernel loads whole tiles).
Activations quantize(const torch::Tensor& x, int64_t row_multiple = 1) {
  const int64_t m = x.size(0), k = x.size(1), padded = (m + row_multiple - 1) / row_multiple * row_multiple;
  Activations a{k, k / GROUP, std::vector<int8_t>(padded * k), std::vector<float>(m * (k / GROUP)),
                std::vector<int32_t>(m * (k / 16))};
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), m, a);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "kquants: x must be fp32 or bf16");
    quantize_rows(x.data_ptr<at::BFloat16>(), m, a);
  }
  return a;
}

inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 ucodes16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 scodes16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void prefetch(const uint8_t* p, int bytes, int ahead = PREFETCH) {
  for (int off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + ahead + off), _MM_HINT_T0);
}

// One type's packed layout: a superblock header, then one line per group.
template <int HEADER, int LINE>
struct Layout {
  static constexpr int header = HEADER, stride = LINE, super_bytes = HEADER + SUPER * LINE;
  static int64_t block_bytes(int64_t groups) {
    return (groups / SUPER) * super_bytes + (groups % SUPER ? HEADER + (groups % SUPER) * LINE : 0);
  }
};
using Q4Layout = Layout<128, 64 + GROUP_BYTES>;        // d, dmin | sc, m codes, nibbles
using Q5Layout = Layout<128, 64 + GROUP_BYTES + 128>;  // d, dmin | sc, m codes, nibbles, fifth bits
using Q6Layout = Layout<64, 64 + GROUP_BYTES + 256>;   // d | sc codes (two sub-blocks), nibbles, top bits
using Q8Layout = Layout<0, 64 + 2 * GROUP_BYTES>;      // | d, codes + 128

// One call's shapes: x [M, K] (fp32 or bf16, checked when quantised), packed [N/32, block_bytes(K/32)].
struct LinearShape {
  int64_t m, k, groups, blocks, n, stride;
};

inline LinearShape check_linear(const char* name, const torch::Tensor& x, const torch::Tensor& packed,
                                int64_t (*block_bytes)(int64_t)) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": x must be a contiguous [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1), groups = k / GROUP;
  TORCH_CHECK(k % GROUP == 0 && packed.dim() == 2 && packed.is_contiguous() && packed.size(1) == block_bytes(groups),
              name, ": packed must be [N/32, block_bytes(K/32)] for this K");
  return {m, k, groups, packed.size(0), packed.size(0) * 2 * LANES, packed.size(1)};
}

// y [M, N] fp32 plus the bias (fp32 [N], or empty), in x's dtype.
inline torch::Tensor finish_linear(torch::Tensor y, const torch::Tensor& x, const torch::Tensor& bias) {
  if (bias.defined() && bias.numel() > 0) y.add_(bias);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// vpdpbusd on codes below 128 (Q4_K's, Q5_K's, Q6_K's) by activations in -127..127: emulated on AVX2
// (the AVX512 loop built with -DSPECWOOD_EMULATED_DOTS, the AVX2 dots' test reference) it sums
// products in int16 pairs (exact for such operands), three instructions where the general case
// (Q8_0's codes + 128) takes nine.
inline __m512i dot_codes(__m512i acc, __m512i codes, __m512i x) {
#ifdef SPECWOOD_AVX2
  return avx2::dpbusd_small(acc, codes, x);
#else
  return _mm512_dpbusd_epi32(acc, codes, x);
#endif
}

// One row's integer dots of a block's two registers, closed: acc += xs * (d * (dot - offset)), the
// offset being the codes' bias times the activations' code sum (Q6_K's -32, Q8_0's +128).
inline void add_offset_dot(__m512 (&acc)[2], const __m512i (&dot)[2], int32_t offset, __m512 da, __m512 db,
                           float xs) {
  const __m512i off = _mm512_set1_epi32(offset);
  const __m512 scale = _mm512_set1_ps(xs);
  acc[0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[0], off)), da), scale, acc[0]);
  acc[1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[1], off)), db), scale, acc[1]);
}

// A group's codes for chunk c (8 inputs) of a block's two halves of 16 channels: lo the inputs
// 8c..8c+3, hi 8c+4..8c+7, each as 16 channels x 4 codes (vpdpbusd's operand and an AMX tile row).
struct Chunk {
  __m512i lo_a, hi_a, lo_b, hi_b;
};

// Q4_K (Q5_K with FIFTH): the low nibbles, and for Q5_K the fifth bits as one 64-bit mask per
// vector of codes, so setting them is one masked move.
template <bool FIFTH>
inline Chunk q4_chunk(const uint8_t* wg, int c) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i pa = _mm512_loadu_si512(wg + c * 64);
  const __m512i pb = _mm512_loadu_si512(wg + HALF_BYTES + c * 64);
  Chunk u{_mm512_and_si512(pa, low), _mm512_and_si512(_mm512_srli_epi16(pa, 4), low), _mm512_and_si512(pb, low),
          _mm512_and_si512(_mm512_srli_epi16(pb, 4), low)};
  if constexpr (FIFTH) {  // masks per half and chunk: the low nibbles' fifth bits, the high ones'
    const __m512i fifth = _mm512_set1_epi8(0x10);
    uint64_t m[4];
    for (int h = 0; h < 2; ++h) std::memcpy(m + 2 * h, wg + GROUP_BYTES + (h * 4 + c) * 16, 16);
    u.lo_a = _mm512_or_si512(u.lo_a, _mm512_maskz_mov_epi8(_cvtu64_mask64(m[0]), fifth));
    u.hi_a = _mm512_or_si512(u.hi_a, _mm512_maskz_mov_epi8(_cvtu64_mask64(m[1]), fifth));
    u.lo_b = _mm512_or_si512(u.lo_b, _mm512_maskz_mov_epi8(_cvtu64_mask64(m[2]), fifth));
    u.hi_b = _mm512_or_si512(u.hi_b, _mm512_maskz_mov_epi8(_cvtu64_mask64(m[3]), fifth));
  }
  return u;
}

// Q6_K: the low nibbles as Q4_K's, the top two bits of the codes of chunks 2s and 2s+1 (sub-block
// s) in one 64-byte vector per half (ha, hb): bits 0-1 / 2-3 the low / high nibbles of chunk 2s,
// bits 4-5 / 6-7 those of chunk 2s+1 (cc says which).
inline Chunk q6_chunk(const uint8_t* wg, __m512i ha, __m512i hb, int c, int cc) {
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  const __m512i pa = _mm512_loadu_si512(wg + c * 64);
  const __m512i pb = _mm512_loadu_si512(wg + HALF_BYTES + c * 64);
  // the top bits of this chunk's low and high nibbles, moved to bits 4-5
  const __m512i tla = cc ? ha : _mm512_slli_epi16(ha, 4), tha = cc ? _mm512_srli_epi16(ha, 2) : _mm512_slli_epi16(ha, 2);
  const __m512i tlb = cc ? hb : _mm512_slli_epi16(hb, 4), thb = cc ? _mm512_srli_epi16(hb, 2) : _mm512_slli_epi16(hb, 2);
  return {_mm512_or_si512(_mm512_and_si512(pa, low), _mm512_and_si512(tla, top)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(pa, 4), low), _mm512_and_si512(tha, top)),
          _mm512_or_si512(_mm512_and_si512(pb, low), _mm512_and_si512(tlb, top)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(pb, 4), low), _mm512_and_si512(thb, top))};
}

// One row's Q4_K / Q5_K group closed: acc += xs * (d*sc * dot - dmin*m * sum(xq)).
inline void add_min_dot(__m512 (&acc)[2], const __m512i (&dot)[2], int32_t codesum, __m512 sca, __m512 scb,
                        __m512 mna, __m512 mnb, float xs) {
  const __m512 sum = _mm512_set1_ps(static_cast<float>(codesum));
  const __m512 scale = _mm512_set1_ps(xs);
  const __m512 ta = _mm512_fnmadd_ps(mna, sum, _mm512_mul_ps(_mm512_cvtepi32_ps(dot[0]), sca));
  const __m512 tb = _mm512_fnmadd_ps(mnb, sum, _mm512_mul_ps(_mm512_cvtepi32_ps(dot[1]), scb));
  acc[0] = _mm512_fmadd_ps(ta, scale, acc[0]);
  acc[1] = _mm512_fmadd_ps(tb, scale, acc[1]);
}

}  // namespace
