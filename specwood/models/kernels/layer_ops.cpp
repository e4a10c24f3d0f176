// The small operations of a decoder layer for x86 CPUs with AVX512: RMSNorm, the rotary embedding,
// the SiLU-gated product, attention (any number of query rows, each computed alone) and a MoE
// router's small linear (each row's dots alone). With
// -DSPECWOOD_AVX2 the same source builds for AVX2 + FMA CPUs (avx512_on_avx2.h), to the same bits.
//
// Why: at one to a few rows a forward, each of these is a microsecond of arithmetic behind torch's
// dispatch (a norm is 7 operators, RoPE 9, flash attention's setup tens of microseconds a layer),
// so a 0.5B draft's one-token forward spent about as long between the weight kernels as in them
// (BENCHMARKS.md §7o). Here each is one call.
//
// Row-exact: every row is computed on its own, in one fixed order, whatever the other rows are.
// Attention goes further: it skips masked keys before anything is summed, so a query's result
// depends only on the keys it may see, in slot order -- a tree node attends over its prefix and
// ancestors exactly as the one-token forward along its path does once those tokens sit in
// consecutive slots.
// Only the headers it needs (not torch/extension.h): a third of the compile time, which a fresh
// machine's first run waits for.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
#include <immintrin.h>
#ifdef SPECWOOD_AVX2
#include "avx512_on_avx2.h"
#endif
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {  // round to nearest even, as torch's casts
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
// the value a store to T and a load back would give (bf16 rounding; identity for fp32)
inline __m512 round_to(__m512 v, const float*) { return v; }
inline __m512 round_to(__m512 v, const at::BFloat16*) {
  alignas(64) at::BFloat16 tmp[16];
  store16(tmp, v);
  return load16(tmp);
}

// One fixed association for every 16-lane sum: halves, then quarters, ...
inline float sum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 e = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(e, _mm_shuffle_ps(e, e, 1)));
}

// e^x, 16 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6 (relative error
// ~2e-7); lanes below -87 give exactly 0 (masked scores are -inf).
inline __m512 exp16(__m512 x) {
  const __mmask16 alive = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(alive, _mm512_scalef_ps(p, n));
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t m, int64_t k, float eps) {
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * k;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < k; i += 16) {
        const __m512 v = load16(row + i);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(sum16(ss) / static_cast<float>(k) + eps));
      // normalised, rounded to the activations' dtype, then times the weight (as the torch module)
      for (int64_t i = 0; i < k; i += 16)
        store16(out + r * k + i, _mm512_mul_ps(load16(w + i), round_to(_mm512_mul_ps(load16(row + i), inv), x)));
    }
  });
}

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {
  alignas(64) at::BFloat16 tmp[16];
  store16(tmp, v);
  _mm256_mask_storeu_epi16(p, m, _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp)));
}
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }

// In place: the first `heads` heads of each row (head_dim d, even) rotated by that row's cos/sin [d].
template <typename T>
void rope_rows(T* x, int64_t row_stride, const float* cos, const float* sin, int64_t m, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cos + r * d;
      const float* s = sin + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + r * row_stride + h * d;
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 lanes = first_lanes(half - i);
          const __m512 a = load16(v + i, lanes), b = load16(v + half + i, lanes);
          // x * cos + rotate_half(x) * sin, rotate_half(x) = (-b, a); no fused multiply-add
          const __m512 lo = _mm512_add_ps(_mm512_mul_ps(a, load16(c + i, lanes)),
                                          _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b), load16(s + i, lanes)));
          const __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, load16(c + half + i, lanes)), _mm512_mul_ps(a, load16(s + half + i, lanes)));
          store16(v + i, lo, lanes);
          store16(v + half + i, hi, lanes);
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t m, int64_t inter) {
  at::parallel_for(0, m, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      for (int64_t i = 0; i < inter; i += 16) {
        const __m512 x = load16(g + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 silu = round_to(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)), g);
        store16(out + r * inter + i, _mm512_mul_ps(silu, load16(u + i)));
      }
    }
  });
}

// Lane i of the result is the sum of v[i]'s 16 lanes. Every register goes through the same tree
// ((e0 + e2) + (e1 + e3) in each 128-bit quarter, then (Q0 + Q1) + (Q2 + Q3)), so a score does not
// depend on the position its key takes in a block. Three shuffles and an add per pair of registers
// at each of four levels: about 3 operations a sum instead of sum16's 7. The tree's first two levels
// take four registers at a time (sum4x16_quarters), so a caller may feed it keys four by four.
inline __m512 sum4x16_quarters(const __m512 (&v)[4]) {
  __m512 t[2];
  for (int p = 0; p < 2; ++p) t[p] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]), _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]));
  const __m512d a = _mm512_castps_pd(t[0]), b = _mm512_castps_pd(t[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}
// The last two levels over four sum4x16_quarters results (of registers 0-3, 4-7, 8-11, 12-15).
inline __m512 sum16x16_finish(const __m512 (&u)[4]) {
  __m512 w[2];
  for (int p = 0; p < 2; ++p)
    w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m512 sum16x16(const __m512 (&v)[16]) {
  __m512 u[4];
  for (int p = 0; p < 4; ++p) u[p] = sum4x16_quarters({v[4 * p], v[4 * p + 1], v[4 * p + 2], v[4 * p + 3]});
  return sum16x16_finish(u);
}

// Lane-wise partial products of q and k (d values each, widened to fp32); their 16 lanes sum to q . k.
template <typename T>
inline __m512 partial_dot(const T* q, const T* k, int64_t d) {
  __m512 acc = _mm512_mul_ps(load16(q), load16(k));
  for (int64_t i = 16; i < d; i += 16) acc = _mm512_fmadd_ps(load16(q + i), load16(k + i), acc);
  return acc;
}

// Per-call scratch of one thread.
struct AttentionScratch {
  std::vector<int32_t> keys;
  std::vector<float> key_bias, scores, inverse;
  std::vector<at::BFloat16> probs;
};

// out[i] = acc[i / 16] * inverse for i < 16 * chunks: a head's value sums, normalised.
template <typename T>
inline void store_normalised(T* out, const __m512* acc, int64_t chunks, float inverse) {
  const __m512 norm = _mm512_set1_ps(inverse);
  for (int64_t c = 0; c < chunks; ++c) store16(out + c * 16, _mm512_mul_ps(acc[c], norm));
}

// bf16 pairs straight into fp32 sums (vdpbf16ps) where the CPU has AVX512-BF16 and the head size
// is 64 or 128 (compiled in, see attend_token): no widening of q, k or v, and half the multiply instructions. Products of two
// bf16 values are exact in fp32, so the scores lose nothing; the probabilities go to bf16 for the
// product with v, as torch's flash attention does for bf16.
#ifdef __AVX512BF16__
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// The scores of HB consecutive heads of one query token (q [HB, D]) over one block of up to 16
// visible keys (keys, key_bias: the block's entries), into scores[h * padded] (scaled, key_bias
// added). Each key's row is loaded once for all HB heads and the heads' q sit in registers (one
// head at a time loaded q and k for every product: two loads a vdpbf16ps, a quarter of the chip's
// bf16 rate). A score is one chain of C products from zero and the sum16x16 tree, whichever heads
// come with it, so the result is bit-identical to scoring the heads one by one.
template <int D, int HB>
void score_block_pairs(const at::BFloat16* q, const at::BFloat16* k, int64_t key_stride, const int32_t* keys,
                       const float* key_bias, int64_t count, __m512 scale16, float* scores, int64_t padded) {
  constexpr int C = D / 32;
  __m512i qv[HB][C];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < C; ++c) qv[h][c] = _mm512_loadu_si512(q + h * D + 32 * c);
  __m512 quarters[HB][4];
  for (int quad = 0; quad < 4; ++quad) {
    __m512 acc[HB][4];
    for (int j = 0; j < 4; ++j) {
      const int64_t i = 4 * quad + j;
      for (int h = 0; h < HB; ++h) acc[h][j] = _mm512_setzero_ps();
      if (i >= count) continue;
      const at::BFloat16* kr = k + keys[i] * key_stride;
      for (int c = 0; c < C; ++c) {
        const __m512i kv = _mm512_loadu_si512(kr + 32 * c);
        for (int h = 0; h < HB; ++h) acc[h][j] = dot_pairs(acc[h][j], qv[h][c], kv);
      }
    }
    for (int h = 0; h < HB; ++h) quarters[h][quad] = sum4x16_quarters(acc[h]);
  }
  const __m512 kb = _mm512_maskz_loadu_ps(first_lanes(count), key_bias);
  for (int h = 0; h < HB; ++h)
    _mm512_storeu_ps(scores + h * padded, _mm512_add_ps(_mm512_mul_ps(sum16x16_finish(quarters[h]), scale16), kb));
}

// fn(std::integral_constant<int, HB>(), g) for the heads [0, groups) in blocks of MAX (HB = MAX),
// the last block the rest.
template <int MAX, typename Fn>
inline void for_head_blocks(int64_t groups, Fn&& fn) {
  static_assert(MAX >= 1 && MAX <= 4, "the rest is 1 to 3 heads");
  int64_t g = 0;
  for (; g + MAX <= groups; g += MAX) fn(std::integral_constant<int, MAX>(), g);
  const int64_t rest = groups - g;
  if constexpr (MAX > 3) if (rest == 3) fn(std::integral_constant<int, 3>(), g);
  if constexpr (MAX > 2) if (rest == 2) fn(std::integral_constant<int, 2>(), g);
  if constexpr (MAX > 1) if (rest == 1) fn(std::integral_constant<int, 1>(), g);
}

// sum_a p[a] v[keys[a]] for HB heads at once, two keys per vdpbf16ps: lane pairs (v_a[i], v_a+1[i])
// against the probability pair (p_a, p_a+1) in bf16. The pairs follow the order of the visible
// keys, so a tree node pairs its keys as the one-token forward along its path does. The two value
// rows are interleaved within each 128-bit quarter (one-cycle unpacks; a full interleave across
// the register took a slow two-source permute per register): acc[h][2c] holds dimensions 32c +
// 8j + {0..3} in lanes 4j..4j+3 and acc[h][2c + 1] dimensions 32c + 8j + {4..7}, which
// in_dimension_order puts back once per call. Each dimension's sum takes the same products in the
// same order either way.
template <int HB, int D>
void weigh_values_pairs(const at::BFloat16* v, int64_t key_stride, const int32_t* keys, int64_t n,
                        const uint32_t* const (&prob_pairs)[HB], const at::BFloat16* zero_row, __m512 (&acc)[HB][8]) {
  static_assert(D % 32 == 0 && D <= 128, "acc holds 8 registers of 16 sums a head");
  constexpr int chunks = D / 32;
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < 2 * chunks; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t a = 0; a < n; a += 2) {
    const at::BFloat16* v0 = v + keys[a] * key_stride;
    const at::BFloat16* v1 = a + 1 < n ? v + keys[a + 1] * key_stride : zero_row;
    __m512i p[HB];
    for (int h = 0; h < HB; ++h) p[h] = _mm512_set1_epi32(static_cast<int32_t>(prob_pairs[h][a / 2]));
    for (int c = 0; c < chunks; ++c) {
      const __m512i x = _mm512_loadu_si512(v0 + 32 * c), y = _mm512_loadu_si512(v1 + 32 * c);
      const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
      for (int h = 0; h < HB; ++h) {
        acc[h][2 * c] = dot_pairs(acc[h][2 * c], lo, p[h]);
        acc[h][2 * c + 1] = dot_pairs(acc[h][2 * c + 1], hi, p[h]);
      }
    }
  }
}

// weigh_values_pairs' sums of 32 dimensions (lo, hi) in dimension order.
inline void in_dimension_order(__m512& lo, __m512& hi) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 a = _mm512_permutex2var_ps(lo, first, hi), b = _mm512_permutex2var_ps(lo, second, hi);
  lo = a;
  hi = b;
}

// weigh_values_pairs for HB consecutive heads (probs [HB, padded] in bf16, the sums' inverses
// [HB]), normalised into out [HB, D].
template <int HB, int D>
void weigh_heads_pairs(const at::BFloat16* v, int64_t key_stride, const int32_t* keys, int64_t n,
                       const at::BFloat16* probs, int64_t padded, const float* inverse, at::BFloat16* out) {
  alignas(64) static const at::BFloat16 zero_row[128] = {};
  const uint32_t* prob_pairs[HB];
  for (int h = 0; h < HB; ++h) prob_pairs[h] = reinterpret_cast<const uint32_t*>(probs + h * padded);
  __m512 acc[HB][8];
  weigh_values_pairs<HB, D>(v, key_stride, keys, n, prob_pairs, zero_row, acc);
  for (int h = 0; h < HB; ++h) {
    for (int c = 0; c < D / 32; ++c) in_dimension_order(acc[h][2 * c], acc[h][2 * c + 1]);
    store_normalised(out + h * D, acc[h], D / 16, inverse[h]);
  }
}

#endif  // __AVX512BF16__

// Attention of one token's `groups` query heads (sharing KV head kvh) over the keys its mask row
// lets it see. q [groups, d] at q (head stride d), k/v rows at key_stride, bias [S] additive
// (-inf = masked), out [groups, d]. D: d known at compile time (0: any), so the value sums of the
// bf16 path stay in registers.
template <typename T, int D>
void attend_token(const T* q, const T* k, const T* v, int64_t key_stride, const T* bias, int64_t s_len,
                  int64_t groups, int64_t any_d, float scale, T* out, AttentionScratch& scratch) {
  const int64_t d = D ? D : any_d;
  const int64_t chunks = d / 16;
  // bf16 pairs (vdpbf16ps) for bf16 heads of 64 or 128 where the CPU has AVX512-BF16
#ifdef __AVX512BF16__
  constexpr bool pairs = std::is_same<T, at::BFloat16>::value && (D == 64 || D == 128);
#endif
  // The visible keys in slot order, 16 bias entries at a time (compressed in a register: Zen 4's
  // compressing store to memory is microcoded and slow).
  std::vector<int32_t>& keys = scratch.keys;
  std::vector<float>& key_bias = scratch.key_bias;
  keys.resize(s_len + 16);
  key_bias.resize(s_len + 16);
  const __m512 masked = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t n = 0;
  for (int64_t j = 0; j < s_len; j += 16) {
    const __m512 b = load16(bias + j, first_lanes(s_len - j));
    const __mmask16 seen = _mm512_cmp_ps_mask(b, masked, _CMP_NEQ_UQ) & first_lanes(s_len - j);
    const __m512i idx = _mm512_add_epi32(lane_index, _mm512_set1_epi32(static_cast<int32_t>(j)));
    _mm512_storeu_si512(keys.data() + n, _mm512_maskz_compress_epi32(seen, idx));
    _mm512_storeu_ps(key_bias.data() + n, _mm512_maskz_compress_ps(seen, b));
    n += __builtin_popcount(seen);
  }
  const int64_t padded = (n + 31) / 32 * 32;  // whole blocks of 16 scores, whole pairs of bf16
  std::vector<float>& scores = scratch.scores;
  scores.resize(groups * padded);
  // Scores, 16 keys a block: each key's row is read from L1 by every head of the group.
  const __m512 scale16 = _mm512_set1_ps(scale);
#ifdef __AVX512BF16__
  if constexpr (pairs) {  // heads 3 or 4 at a time (register room: q, the products and a key chunk)
    for (int64_t a0 = 0; a0 < n; a0 += 16)  // a block's key rows stay in L1 for all the heads
      for_head_blocks<D == 128 ? 3 : 4>(groups, [&](auto hb, int64_t g) {
        score_block_pairs<D, decltype(hb)::value>(q + g * d, k, key_stride, keys.data() + a0, key_bias.data() + a0,
                                                  std::min<int64_t>(16, n - a0), scale16, scores.data() + g * padded + a0, padded);
      });
  } else
#endif
  {
    for (int64_t a0 = 0; a0 < n; a0 += 16) {
      const int64_t count = std::min<int64_t>(16, n - a0);
      const __m512 kb = _mm512_maskz_loadu_ps(first_lanes(count), key_bias.data() + a0);
      for (int64_t g = 0; g < groups; ++g) {
        __m512 acc[16];
        for (int64_t i = 0; i < 16; ++i)
          acc[i] = i < count ? partial_dot(q + g * d, k + keys[a0 + i] * key_stride, d) : _mm512_setzero_ps();
        _mm512_storeu_ps(scores.data() + g * padded + a0, _mm512_add_ps(_mm512_mul_ps(sum16x16(acc), scale16), kb));
      }
    }
  }
  // Softmax of each head's scores, in the order of the visible keys.
  std::vector<float>& inverse = scratch.inverse;
  inverse.resize(groups);
  for (int64_t g = 0; g < groups; ++g) {
    float* sg = scores.data() + g * padded;
    __m512 highest = masked;
    for (int64_t a = 0; a < n; a += 16) highest = _mm512_max_ps(highest, _mm512_mask_loadu_ps(masked, first_lanes(n - a), sg + a));
    const float top = _mm512_reduce_max_ps(highest);
    __m512 total = _mm512_setzero_ps();
    const __m512 shift = _mm512_set1_ps(top);
    for (int64_t a = 0; a < n; a += 16) {
      const __mmask16 lanes = first_lanes(n - a);
      const __m512 p = _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, sg + a), shift)));
      _mm512_mask_storeu_ps(sg + a, lanes, p);
      total = _mm512_add_ps(total, p);
    }
    inverse[g] = n > 0 ? 1.f / sum16(total) : 0.f;
  }
#ifdef __AVX512BF16__
  if constexpr (pairs) {
    std::vector<at::BFloat16>& probs = scratch.probs;
    probs.resize(groups * padded);
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t a = 0; a < padded; a += 16)
        store16(probs.data() + g * padded + a, _mm512_maskz_loadu_ps(a < n ? first_lanes(n - a) : 0, scores.data() + g * padded + a));
    // heads 3 or 4 at a time: each pair of value rows is loaded and interleaved once for them all
    for_head_blocks<D == 128 ? 3 : 4>(groups, [&](auto hb, int64_t g) {
      weigh_heads_pairs<decltype(hb)::value, D>(v, key_stride, keys.data(), n, probs.data() + g * padded, padded,
                                                inverse.data() + g, out + g * d);
    });
    return;
  }
#endif
  for (int64_t g = 0; g < groups; ++g) {
    const float* sg = scores.data() + g * padded;
    __m512 acc[16];
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t a = 0; a < n; ++a) {
      const __m512 p = _mm512_set1_ps(sg[a]);
      const T* vr = v + keys[a] * key_stride;
      for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(p, load16(vr + c * 16), acc[c]);
    }
    store_normalised(out + g * d, acc, chunks, inverse[g]);
  }
}

template <typename T>
void attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                    float scale, at::Tensor& out) {
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), d = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), groups = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* bp = bias.data_ptr<T>();
  T* op = out.data_ptr<T>();
  auto* attend = d == 128 ? attend_token<T, 128> : d == 64 ? attend_token<T, 64> : attend_token<T, 0>;
  at::parallel_for(0, B * Hkv * T_, 1, [&](int64_t i0, int64_t i1) {
    AttentionScratch scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (Hkv * T_), h = (i / T_) % Hkv, t = i % T_;
      attend(qp + b * q.stride(0) + t * q.stride(1) + h * groups * q.stride(2),
             kp + b * k.stride(0) + h * k.stride(1), vp + b * v.stride(0) + h * v.stride(1), k.stride(2),
             bp + b * bias.stride(0) + t * bias.stride(2), S, groups, d, scale,
             op + (b * T_ + t) * H * d + h * groups * d, scratch);
    }
  });
}

// out[r, n] = x[r] . w[n] for every row r and output n, each dot on its own: partial_dot's 16-lane
// chain over K in order, then sum16 -- the same bits for a row alone or among any others, on any
// number of threads (a thread takes whole dots). Four outputs share each load of x's chunk.
template <typename T>
void linear_rows_impl(const T* x, const T* w, T* out, int64_t m, int64_t n, int64_t k) {
  const int64_t quads = (n + 3) / 4;
  at::parallel_for(0, m * quads, std::max<int64_t>(1, 16384 / k), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / quads, n0 = (i % quads) * 4;
      const T* xr = x + r * k;
      T* o = out + r * n;
      if (n0 + 4 > n) {  // the last outputs: the same chain, one output at a time
        for (int64_t j = n0; j < n; ++j) o[j] = static_cast<T>(sum16(partial_dot(xr, w + j * k, k)));
        continue;
      }
      const T* w0 = w + n0 * k;
      __m512 xv = load16(xr);
      __m512 a0 = _mm512_mul_ps(xv, load16(w0)), a1 = _mm512_mul_ps(xv, load16(w0 + k));
      __m512 a2 = _mm512_mul_ps(xv, load16(w0 + 2 * k)), a3 = _mm512_mul_ps(xv, load16(w0 + 3 * k));
      for (int64_t c = 16; c < k; c += 16) {
        xv = load16(xr + c);
        a0 = _mm512_fmadd_ps(xv, load16(w0 + c), a0);
        a1 = _mm512_fmadd_ps(xv, load16(w0 + k + c), a1);
        a2 = _mm512_fmadd_ps(xv, load16(w0 + 2 * k + c), a2);
        a3 = _mm512_fmadd_ps(xv, load16(w0 + 3 * k + c), a3);
      }
      o[n0] = static_cast<T>(sum16(a0));
      o[n0 + 1] = static_cast<T>(sum16(a1));
      o[n0 + 2] = static_cast<T>(sum16(a2));
      o[n0 + 3] = static_cast<T>(sum16(a3));
    }
  });
}

void check_rows(const at::Tensor& x, int64_t width, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what, ": fp32 or bf16 only");
  TORCH_CHECK(width % 16 == 0, what, ": the row width must be a multiple of 16");
}

}  // namespace

// x [M, K] contiguous, weight [K] (x's dtype) -> [M, K]
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x [M, K] contiguous and a weight of its dtype");
  check_rows(x, x.size(1), "rms_norm");
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), eps);
  else
    rms_norm_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                  x.size(0), x.size(1), eps);
  return out;
}

// In place on x [M, W] (rows at any stride, elements contiguous): heads 0..heads-1 of width d
// rotated by cos/sin [M, d] fp32.
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t d) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && heads * d <= x.size(1), "rope_: x must be [M, W] with unit stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              cos.numel() == x.size(0) * d && sin.numel() == cos.numel(), "rope_: cos/sin must be [M, d] fp32");
  TORCH_CHECK(d % 2 == 0 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), "rope_: even d, fp32 or bf16");
  if (x.scalar_type() == at::kFloat)
    rope_rows(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), heads, d);
  else
    rope_rows(x.data_ptr<at::BFloat16>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), heads, d);
}

// gate_up [M, 2I] contiguous -> silu(gate) * up [M, I]
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "silu_mul: [M, 2I] contiguous");
  const int64_t inter = gate_up.size(1) / 2;
  check_rows(gate_up, inter, "silu_mul");
  auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat)
    silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), gate_up.size(0), inter);
  else
    silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), gate_up.size(0), inter);
  return out;
}

// q [B, T, H, d] (last dim contiguous), k/v [B, Hkv, S, d] (last dim contiguous, same strides),
// bias [B, 1, >=T, S] additive (-inf = masked; row t is token t's) -> [B, T, H * d]
at::Tensor attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor bias, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && bias.dim() == 4, "attention: 4-d inputs");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && bias.stride(3) == 1 &&
              k.strides() == v.strides() && k.sizes() == v.sizes(), "attention: unit stride in the last dim");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
              bias.scalar_type() == q.scalar_type(), "attention: one dtype");
  const int64_t d = q.size(3);
  TORCH_CHECK(d % 16 == 0 && d <= 256 && q.size(2) % k.size(1) == 0 && k.size(3) == d, "attention: head sizes");
  TORCH_CHECK(bias.size(0) == q.size(0) && bias.size(2) >= q.size(1) && bias.size(3) == k.size(2), "attention: bias shape");
  check_rows(q, d, "attention");
  auto out = at::empty({q.size(0), q.size(1), q.size(2) * d}, q.options());
  if (q.scalar_type() == at::kFloat)
    attention_impl<float>(q, k, v, bias, static_cast<float>(scale), out);
  else
    attention_impl<at::BFloat16>(q, k, v, bias, static_cast<float>(scale), out);
  return out;
}

// x [M, K] contiguous, weight [N, K] contiguous (x's dtype) -> x @ weight.T [M, N], row-exact
at::Tensor linear_rows(at::Tensor x, at::Tensor weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.is_contiguous() && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type() && weight.size(1) == x.size(1) && x.size(1) > 0,
              "linear_rows: x [M, K] and weight [N, K] contiguous, one dtype");
  check_rows(x, x.size(1), "linear_rows");
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.scalar_type() == at::kFloat)
    linear_rows_impl(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), weight.size(0), x.size(1));
  else
    linear_rows_impl(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                     x.size(0), weight.size(0), x.size(1));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("rms_norm", &rms_norm, "RMSNorm of each row");
  mod.def("rope_", &rope_, "rotary embedding, in place");
  mod.def("silu_mul", &silu_mul, "silu(gate) * up");
  mod.def("attention", &attention, "attention, each query row alone, masked keys skipped");
  mod.def("linear_rows", &linear_rows, "x @ weight.T, each row's dots alone in one fixed order");
}
