// Linears on GGUF k-quant weights, as the file stores them, for x86 CPUs with AVX512-VNNI:
//  - Q4_K: per group of 32 inputs a 6-bit scale code sc and minimum code m, per superblock of 256
//    inputs an fp16 d and dmin: w = d * sc * q - dmin * m, q in 0..15;
//  - Q5_K: Q4_K with a fifth bit, q in 0..31;
//  - Q6_K: per sub-block of 16 inputs an int8 scale code sc, per superblock an fp16 d:
//    w = d * sc * (q - 32), q in 0..63;
//  - Q8_0: per group of 32 inputs an fp16 d: w = d * q, q in -128..127 (Q4_0 and Q5_0 are held as
//    Q8_0, exactly: their d * (q - 8) and d * (q - 16) are such values).
// times int8 activations quantised per group of 32 inputs (llama.cpp's Q8_0 granularity; its
// k-quant dot products use one scale per 256, Q8_K, so ours is at least as fine).
//
// Why our own kernel: torch 2.13's int4 kernels read int4 weights at a fraction of this CPU's
// bandwidth for one row and slow down fast with more rows (BENCHMARKS.md §7k, §7l). Here 16 output
// channels sit interleaved in one 512-bit register (4 inputs each), so one vpdpbusd multiplies 64
// weights by 4 activations broadcast from memory. Weights come in blocks of 32 channels, so each
// broadcast feeds two vpdpbusd (the loads, not the multiplies, bound the loop from a few rows on),
// and once unpacked they serve up to 8 rows. The weights are prefetched a few KB ahead: without it
// the DRAM stream stalls whenever a tile's multiplies run.
// A block's bytes are one stream: per superblock a header (d, and dmin for Q4_K, of its 32
// channels, fp16), then per group of 32 inputs one line: the scale (and minimum) codes, the 512
// bytes of low nibbles, and for Q5_K 128 bytes of the codes' fifth bits, for Q6_K 256 bytes of
// their top two bits. That is the file's own size (Q4_K: 4.625 bits a weight; Q5_K 5.625, Q6_K
// 6.5625). Q8_0 has no header; its line is the 32 channels' d and the codes as bytes (8.5 bits).
//
// Row-exact: a row's result takes the same integer and float operations in the same order
// whatever the other rows are, so a tree verified in one call gives each node what a one-row call
// gives (what keeps speculation lossless against our own ar).
#include <ATen/Parallel.h>

#include "kquants_common.h"

namespace {

constexpr int MAX_TILE = 8;  // rows multiplied per pass over a block's weights

template <int TILE>
inline void zero_tile(__m512 (&acc)[TILE][2]) {
  for (int r = 0; r < TILE; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
}

// A tile's rows of one block of 32 output channels into y [M, N].
template <int TILE>
inline void store_tile(const __m512 (&acc)[TILE][2], float* y, int64_t n, int64_t block) {
  for (int r = 0; r < TILE; ++r) {
    _mm512_storeu_ps(y + r * n + block * 2 * LANES, acc[r][0]);
    _mm512_storeu_ps(y + r * n + block * 2 * LANES + LANES, acc[r][1]);
  }
}

// One group's integer dots for TILE rows: dot[r][h] (16 channels of half h, int32) = the codes of
// the group's 32 inputs times row r's activation codes (xq: row 0's group, rows k apart). On AVX2
// the loop below is the AVX512 one emulated only with -DSPECWOOD_EMULATED_DOTS (a test's reference).
#if !defined(SPECWOOD_AVX2) || defined(SPECWOOD_EMULATED_DOTS)
// Chunk u's codes times each row's 8 activations of the chunk (x: row 0's, rows k apart).
template <int TILE>
inline void chunk_dots(const Chunk& u, const int8_t* x, int64_t k, __m512i (&dot)[TILE][2]) {
  for (int r = 0; r < TILE; ++r) {
    const __m512i xl = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * k));
    const __m512i xh = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * k + 4));
    dot[r][0] = dot_codes(dot[r][0], u.lo_a, xl);
    dot[r][1] = dot_codes(dot[r][1], u.lo_b, xl);
    dot[r][0] = dot_codes(dot[r][0], u.hi_a, xh);
    dot[r][1] = dot_codes(dot[r][1], u.hi_b, xh);
  }
}

template <int TILE, bool FIFTH>
inline void q4_group_dots(const uint8_t* wg, const int8_t* xq, int64_t k, __m512i (&dot)[TILE][2]) {
  for (int r = 0; r < TILE; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    chunk_dots(q4_chunk<FIFTH>(wg, c), xq + c * 8, k, dot);
  }
}

// Q6_K's sub-block s of a group (chunks 2s and 2s+1), its top bits at `bits`.
template <int TILE>
inline void q6_subblock_dots(const uint8_t* wg, const uint8_t* bits, int s, const int8_t* xq, int64_t k,
                             __m512i (&dot)[TILE][2]) {
  for (int r = 0; r < TILE; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
  const __m512i ha = _mm512_loadu_si512(bits + s * 64), hb = _mm512_loadu_si512(bits + 128 + s * 64);
  for (int cc = 0; cc < 2; ++cc) {
    const int c = 2 * s + cc;
    chunk_dots(q6_chunk(wg, ha, hb, c, cc), xq + c * 8, k, dot);
  }
}
#else
// AVX2 has 16 registers of 256 bits: the emulated 512-bit loop above holds 4 per row of dots and
// spills from two rows on. Here one quarter of the block (8 channels, 32 bytes of codes) for up to
// SUBTILE rows at a time (the codes unpacked again for the next rows: a few instructions against
// their multiplies), each row's products summed in int16 (vpmaddubsw) and widened to int32
// (vpmaddwd by ones) only when the int16 sums could overflow: with codes <= c_max and activations
// |x| <= 127 a vpmaddubsw lane is at most 2 * c_max * 127 in magnitude, and PER_WIDEN of them fit
// in int16. The int32 dots are the integers vpdpbusd gives, so the bits are the AVX512 build's (the
// float epilogue is shared).
constexpr int SUBTILE = 4;

inline __m256i broadcast4(const int8_t* p) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }
inline __m256i widen16(__m256i sums) { return _mm256_madd_epi16(sums, _mm256_set1_epi16(1)); }
inline __m256i& quarter(__m512i& v, int q) { return q % 2 ? v.hi : v.lo; }

// Quarter q of a Q4_K / Q5_K group for ROWS rows from row r0.
template <int ROWS, bool FIFTH, int TILE>
inline void q4_quarter_dots(const uint8_t* wg, int q, const int8_t* xq, int64_t k, int r0, __m512i (&dot)[TILE][2]) {
  constexpr int PER_WIDEN = FIFTH ? 4 : 8;  // Q4_K codes <= 15: 8 x 3810; Q5_K codes <= 31: 4 x 7874
  const __m256i low = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
  const uint8_t* codes = wg + (q / 2) * HALF_BYTES + (q % 2) * 32;  // half q / 2, its channels 0-7 or 8-15
  __m256i sums[ROWS], wide[ROWS];
  for (int r = 0; r < ROWS; ++r) sums[r] = wide[r] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * 64));
    __m256i lo = _mm256_and_si256(p, low), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
    if constexpr (FIFTH) {  // the 64-bit masks of q4_chunk, 32 bits of them for this quarter
      uint32_t m[2];
      for (int n = 0; n < 2; ++n) std::memcpy(m + n, wg + GROUP_BYTES + ((q / 2) * 4 + c) * 16 + n * 8 + (q % 2) * 4, 4);
      lo = _mm256_or_si256(lo, _mm256_and_si256(avx2::byte_mask32(m[0]), fifth));
      hi = _mm256_or_si256(hi, _mm256_and_si256(avx2::byte_mask32(m[1]), fifth));
    }
    for (int r = 0; r < ROWS; ++r) {
      const int8_t* xr = xq + (r0 + r) * k + c * 8;
      sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(lo, broadcast4(xr)));
      sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(hi, broadcast4(xr + 4)));
    }
    if ((2 * (c + 1)) % PER_WIDEN == 0) {
      for (int r = 0; r < ROWS; ++r) {
        wide[r] = _mm256_add_epi32(wide[r], widen16(sums[r]));
        sums[r] = _mm256_setzero_si256();
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) quarter(dot[r0 + r][q / 2], q) = wide[r];
}

template <int TILE, bool FIFTH>
inline void q4_group_dots(const uint8_t* wg, const int8_t* xq, int64_t k, __m512i (&dot)[TILE][2]) {
  for (int q = 0; q < 4; ++q) {
    int r0 = 0;
    for (; r0 + SUBTILE <= TILE; r0 += SUBTILE) q4_quarter_dots<SUBTILE, FIFTH>(wg, q, xq, k, r0, dot);
    if constexpr (TILE % SUBTILE != 0) q4_quarter_dots<TILE % SUBTILE, FIFTH>(wg, q, xq, k, r0, dot);
  }
}

// Quarter q of Q6_K's sub-block s for ROWS rows from row r0. Codes <= 63: a vpmaddubsw lane up to
// 16002, so two (one chunk's low and high inputs) a widening.
template <int ROWS, int TILE>
inline void q6_quarter_dots(const uint8_t* wg, const uint8_t* bits, int s, int q, const int8_t* xq, int64_t k, int r0,
                            __m512i (&dot)[TILE][2]) {
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const uint8_t* codes = wg + (q / 2) * HALF_BYTES + (q % 2) * 32;
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + (q / 2) * 128 + s * 64 + (q % 2) * 32));
  __m256i wide[ROWS];
  for (int r = 0; r < ROWS; ++r) wide[r] = _mm256_setzero_si256();
  for (int cc = 0; cc < 2; ++cc) {
    const int c = 2 * s + cc;
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * 64));
    // q6_chunk's top bits: of the low nibbles at bits 0-1 (cc 0) or 4-5 (cc 1), of the high at 2-3 or 6-7
    const __m256i tl = cc ? h : _mm256_slli_epi16(h, 4), th = cc ? _mm256_srli_epi16(h, 2) : _mm256_slli_epi16(h, 2);
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(p, low), _mm256_and_si256(tl, top));
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p, 4), low), _mm256_and_si256(th, top));
    for (int r = 0; r < ROWS; ++r) {
      const int8_t* xr = xq + (r0 + r) * k + c * 8;
      const __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xr)),
                                            _mm256_maddubs_epi16(hi, broadcast4(xr + 4)));
      wide[r] = _mm256_add_epi32(wide[r], widen16(sums));
    }
  }
  for (int r = 0; r < ROWS; ++r) quarter(dot[r0 + r][q / 2], q) = wide[r];
}

template <int TILE>
inline void q6_subblock_dots(const uint8_t* wg, const uint8_t* bits, int s, const int8_t* xq, int64_t k,
                             __m512i (&dot)[TILE][2]) {
  for (int q = 0; q < 4; ++q) {
    int r0 = 0;
    for (; r0 + SUBTILE <= TILE; r0 += SUBTILE) q6_quarter_dots<SUBTILE>(wg, bits, s, q, xq, k, r0, dot);
    if constexpr (TILE % SUBTILE != 0) q6_quarter_dots<TILE % SUBTILE>(wg, bits, s, q, xq, k, r0, dot);
  }
}
#endif

// Q4_K (and Q5_K, FIFTH): one block of 32 output channels (two registers of 16) for TILE rows.
// d * sc is exact in fp32 (11 by 6 bits), so the weights are exactly the file's.
template <int TILE, bool FIFTH>
void q4_tile(const uint8_t* w, const Activations& a, const float* xs, const int32_t* sums, const int8_t* xq,
             float* y, int64_t n, int64_t block) {
  const int64_t groups = a.groups, k = a.k;
  using L = std::conditional_t<FIFTH, Q5Layout, Q4Layout>;
  __m512 acc[TILE][2];
  zero_tile<TILE>(acc);
  for (int64_t s0 = 0; s0 < groups; s0 += SUPER) {
    const uint8_t* sb = w + (s0 / SUPER) * L::super_bytes;
    const at::Half* hd = reinterpret_cast<const at::Half*>(sb);
    const __m512 da = load_half16(hd), db = load_half16(hd + LANES);
    const __m512 ma = load_half16(hd + 2 * LANES), mb = load_half16(hd + 3 * LANES);
    const int64_t count = std::min<int64_t>(SUPER, groups - s0);
    for (int64_t gi = 0; gi < count; ++gi) {
      const int64_t g = s0 + gi;
      const uint8_t* line = sb + L::header + gi * L::stride;
      const uint8_t* wg = line + 64;
      prefetch(line, L::stride + L::header);  // headers included, at a superblock's start
      __m512i dot[TILE][2];
      q4_group_dots<TILE, FIFTH>(wg, xq + g * GROUP, k, dot);
      const __m512 sca = _mm512_mul_ps(ucodes16(line), da), scb = _mm512_mul_ps(ucodes16(line + LANES), db);
      const __m512 mna = _mm512_mul_ps(ucodes16(line + 2 * LANES), ma), mnb = _mm512_mul_ps(ucodes16(line + 3 * LANES), mb);
      for (int r = 0; r < TILE; ++r)
        add_min_dot(acc[r], dot[r], sums[r * 2 * groups + 2 * g] + sums[r * 2 * groups + 2 * g + 1], sca, scb, mna,
                    mnb, xs[r * groups + g]);
    }
  }
  store_tile<TILE>(acc, y, n, block);
}

// Q6_K (q6_chunk): each sub-block of 16 inputs has its own scale, so its integer dot is closed
// after two chunks: dot(q - 32, xq) = dot(q, xq) - 32 * sum(xq). d * sc is exact in fp32 (11 by 8 bits).
template <int TILE>
void q6_tile(const uint8_t* w, const Activations& a, const float* xs, const int32_t* sums, const int8_t* xq,
             float* y, int64_t n, int64_t block) {
  const int64_t groups = a.groups, k = a.k;
  __m512 acc[TILE][2];
  zero_tile<TILE>(acc);
  for (int64_t s0 = 0; s0 < groups; s0 += SUPER) {
    const uint8_t* sb = w + (s0 / SUPER) * Q6Layout::super_bytes;
    const at::Half* hd = reinterpret_cast<const at::Half*>(sb);
    const __m512 da = load_half16(hd), db = load_half16(hd + LANES);
    const int64_t count = std::min<int64_t>(SUPER, groups - s0);
    for (int64_t gi = 0; gi < count; ++gi) {
      const int64_t g = s0 + gi;
      const uint8_t* line = sb + Q6Layout::header + gi * Q6Layout::stride;
      const uint8_t* wg = line + 64;
      const uint8_t* bits = wg + GROUP_BYTES;
      prefetch(line, Q6Layout::stride + Q6Layout::header);
      for (int s = 0; s < 2; ++s) {
        __m512i dot[TILE][2];
        q6_subblock_dots<TILE>(wg, bits, s, xq + g * GROUP, k, dot);
        const __m512 sca = _mm512_mul_ps(scodes16(line + s * 32), da);
        const __m512 scb = _mm512_mul_ps(scodes16(line + s * 32 + LANES), db);
        for (int r = 0; r < TILE; ++r)
          add_offset_dot(acc[r], dot[r], 32 * sums[r * 2 * groups + 2 * g + s], sca, scb, xs[r * groups + g]);
      }
    }
  }
  store_tile<TILE>(acc, y, n, block);
}

// Q8_0: per group the 32 channels' fp16 d, then the codes + 128 as bytes (vpdpbusd multiplies
// unsigned by signed bytes): dot(q, xq) = dot(q + 128, xq) - 128 * sum(xq), exact in int32.
template <int TILE>
void q8_tile(const uint8_t* w, const Activations& a, const float* xs, const int32_t* sums, const int8_t* xq,
             float* y, int64_t n, int64_t block) {
  const int64_t groups = a.groups, k = a.k;
  __m512 acc[TILE][2];
  zero_tile<TILE>(acc);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* line = w + g * Q8Layout::stride;
    const uint8_t* wg = line + 64;
    prefetch(line, Q8Layout::stride, Q8_PREFETCH);
    __m512i dot[TILE][2];
    for (int r = 0; r < TILE; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const __m512i pa = _mm512_loadu_si512(wg + c * 64);
      const __m512i pb = _mm512_loadu_si512(wg + GROUP_BYTES + c * 64);
      for (int r = 0; r < TILE; ++r) {
        const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + r * k + g * GROUP + c * 4));
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], pa, xv);
        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], pb, xv);
      }
    }
    const at::Half* hd = reinterpret_cast<const at::Half*>(line);
    const __m512 da = load_half16(hd), db = load_half16(hd + LANES);
    for (int r = 0; r < TILE; ++r)
      add_offset_dot(acc[r], dot[r], 128 * (sums[r * 2 * groups + 2 * g] + sums[r * 2 * groups + 2 * g + 1]), da, db,
                     xs[r * groups + g]);
  }
  store_tile<TILE>(acc, y, n, block);
}

using TileFn = void (*)(const uint8_t*, const Activations&, const float*, const int32_t*, const int8_t*, float*,
                       int64_t, int64_t);
const TileFn Q4_TILES[MAX_TILE + 1] = {nullptr, q4_tile<1, false>, q4_tile<2, false>, q4_tile<3, false>,
                                       q4_tile<4, false>, q4_tile<5, false>, q4_tile<6, false>,
                                       q4_tile<7, false>, q4_tile<8, false>};
const TileFn Q5_TILES[MAX_TILE + 1] = {nullptr, q4_tile<1, true>, q4_tile<2, true>, q4_tile<3, true>,
                                       q4_tile<4, true>, q4_tile<5, true>, q4_tile<6, true>,
                                       q4_tile<7, true>, q4_tile<8, true>};
const TileFn Q6_TILES[MAX_TILE + 1] = {nullptr, q6_tile<1>, q6_tile<2>, q6_tile<3>, q6_tile<4>,
                                       q6_tile<5>, q6_tile<6>, q6_tile<7>, q6_tile<8>};
const TileFn Q8_TILES[MAX_TILE + 1] = {nullptr, q8_tile<1>, q8_tile<2>, q8_tile<3>, q8_tile<4>,
                                       q8_tile<5>, q8_tile<6>, q8_tile<7>, q8_tile<8>};

// x [M, K] (fp32 or bf16), packed [N/32, block_bytes] uint8, bias [N] fp32 or empty -> [M, N] in x's dtype.
torch::Tensor run_linear(const TileFn* tiles, int64_t (*block_bytes)(int64_t), const char* name, torch::Tensor x,
                         torch::Tensor packed, torch::Tensor bias) {
  const LinearShape s = check_linear(name, x, packed, block_bytes);
  const Activations a = quantize(x);
  auto y = torch::empty({s.m, s.n}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  at::parallel_for(0, s.blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r = 0; r < s.m; r += MAX_TILE) {
        const int tile = static_cast<int>(std::min<int64_t>(MAX_TILE, s.m - r));
        tiles[tile](wp + b * s.stride, a, a.scale.data() + r * s.groups, a.sums16.data() + r * 2 * s.groups,
                    a.q.data() + r * s.k, yp + r * s.n, s.n, b);
      }
    }
  });
  return finish_linear(y, x, bias);
}

// Routed experts, one call for all (a MoE layer's projection): x [R, K] holds each expert's rows one
// expert after another (counts[e] of them for expert e, in expert order), packed [E, N/32,
// block_bytes] every expert's weights; y [R, N]: each row times its own expert's weights. The rows
// are quantised once and the work items are (expert, block of 32 channels): each expert's weights are
// read once for all its rows, as one run_linear call per expert would read them, with the same tile
// functions on the same rows, so the bits are those calls' bits (row-exact).
torch::Tensor run_experts(const TileFn* tiles, int64_t (*block_bytes)(int64_t), const char* name, torch::Tensor x,
                          torch::Tensor packed, const std::vector<int64_t>& counts) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(0) == static_cast<int64_t>(counts.size()),
              name, ": packed must be [E, N/32, block_bytes] with one count per expert");
  const LinearShape s = check_linear(name, x, packed[0], block_bytes);
  std::vector<int64_t> experts, starts;  // the experts with rows, and where their rows start
  int64_t rows = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    TORCH_CHECK(counts[e] >= 0, name, ": a negative row count");
    if (counts[e] > 0) {
      experts.push_back(e);
      starts.push_back(rows);
    }
    rows += counts[e];
  }
  TORCH_CHECK(rows == s.m, name, ": the counts add up to ", rows, " rows, x has ", s.m);
  const Activations a = quantize(x);
  auto y = torch::empty({s.m, s.n}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t expert_bytes = s.blocks * s.stride;
  at::parallel_for(0, static_cast<int64_t>(experts.size()) * s.blocks, 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = experts[i / s.blocks], b = i % s.blocks, first = starts[i / s.blocks];
      for (int64_t r = first; r < first + counts[e]; r += MAX_TILE) {
        const int tile = static_cast<int>(std::min<int64_t>(MAX_TILE, first + counts[e] - r));
        tiles[tile](wp + e * expert_bytes + b * s.stride, a, a.scale.data() + r * s.groups,
                    a.sums16.data() + r * 2 * s.groups, a.q.data() + r * s.k, yp + r * s.n, s.n, b);
      }
    }
  });
  return finish_linear(y, x, torch::Tensor());
}

}  // namespace

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  return run_linear(Q4_TILES, Q4Layout::block_bytes, "q4_linear", x, packed, bias);
}

torch::Tensor q5_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  return run_linear(Q5_TILES, Q5Layout::block_bytes, "q5_linear", x, packed, bias);
}

torch::Tensor q6_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  return run_linear(Q6_TILES, Q6Layout::block_bytes, "q6_linear", x, packed, bias);
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  return run_linear(Q8_TILES, Q8Layout::block_bytes, "q8_linear", x, packed, bias);
}

torch::Tensor q4_experts(torch::Tensor x, torch::Tensor packed, std::vector<int64_t> counts) {
  return run_experts(Q4_TILES, Q4Layout::block_bytes, "q4_experts", x, packed, counts);
}

torch::Tensor q5_experts(torch::Tensor x, torch::Tensor packed, std::vector<int64_t> counts) {
  return run_experts(Q5_TILES, Q5Layout::block_bytes, "q5_experts", x, packed, counts);
}

torch::Tensor q6_experts(torch::Tensor x, torch::Tensor packed, std::vector<int64_t> counts) {
  return run_experts(Q6_TILES, Q6Layout::block_bytes, "q6_experts", x, packed, counts);
}

torch::Tensor q8_experts(torch::Tensor x, torch::Tensor packed, std::vector<int64_t> counts) {
  return run_experts(Q8_TILES, Q8Layout::block_bytes, "q8_experts", x, packed, counts);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_linear", &q4_linear, "Q4_K weights x int8 activations (AVX512-VNNI)");
  mod.def("q5_linear", &q5_linear, "Q5_K weights x int8 activations (AVX512-VNNI)");
  mod.def("q6_linear", &q6_linear, "Q6_K weights x int8 activations (AVX512-VNNI)");
  mod.def("q8_linear", &q8_linear, "Q8_0 weights x int8 activations (AVX512-VNNI)");
  mod.def("q4_experts", &q4_experts, "routed experts' Q4_K weights x int8 activations, grouped rows (AVX512-VNNI)");
  mod.def("q5_experts", &q5_experts, "routed experts' Q5_K weights x int8 activations, grouped rows (AVX512-VNNI)");
  mod.def("q6_experts", &q6_experts, "routed experts' Q6_K weights x int8 activations, grouped rows (AVX512-VNNI)");
  mod.def("q8_experts", &q8_experts, "routed experts' Q8_0 weights x int8 activations, grouped rows (AVX512-VNNI)");
  mod.def("q4_block_bytes", &Q4Layout::block_bytes, "bytes of one Q4_K block of 32 output channels for K/32 groups");
  mod.def("q5_block_bytes", &Q5Layout::block_bytes, "bytes of one Q5_K block of 32 output channels for K/32 groups");
  mod.def("q6_block_bytes", &Q6Layout::block_bytes, "bytes of one Q6_K block of 32 output channels for K/32 groups");
  mod.def("q8_block_bytes", &Q8Layout::block_bytes, "bytes of one Q8_0 block of 32 output channels for K/32 groups");
}
