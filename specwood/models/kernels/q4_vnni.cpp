// W4A8 linear for x86 CPUs with AVX512-VNNI: 4-bit weights in GGUF Q4_K's form (per group of 32
// inputs a 6-bit scale code sc and minimum code m, per superblock of 8 groups an fp16 d and dmin:
// w = d * sc * q - dmin * m, q in 0..15) times per-row dynamically quantised int8 activations.
//
// Why our own kernel: torch 2.13's int4 kernels read int4 weights at a fraction of this CPU's
// bandwidth for one row and slow down fast with more rows (BENCHMARKS.md §7k, §7l), so a 4-bit
// target was slower than an int8 one. Here 16 output channels sit interleaved in one 512-bit
// register (4 inputs each), so one vpdpbusd multiplies 64 weights by 4 activations broadcast from
// memory. Weights come in blocks of 32 channels, so each broadcast feeds two vpdpbusd (the loads,
// not the multiplies, bound the loop from a few rows on), and once unpacked they serve up to 8 rows.
// The weights are prefetched a few KB ahead: without it the DRAM stream stalls whenever a tile's
// multiplies run, and 8 rows cost the 1-row read plus their compute instead of the larger of the two.
// A block's bytes are one stream: per superblock a header (d and dmin of its 32 channels, fp16),
// then per group one line of codes (sc and m, uint8) and the 512 bytes of nibbles. 592 bytes per
// 1024 weights, against 640 with an fp16 scale and minimum per group: one step reads 7% less, and a
// one-row step is bound by that read (BENCHMARKS.md §7t).
//
// Row-exact: a row's result takes the same integer and float operations in the same order
// whatever the other rows are, so a tree verified in one call gives each node what a one-row call
// gives (the int8 weight mode's property, kept for the same reason: lossless against its own ar).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>

namespace {

constexpr int GROUP = 32;
constexpr int LANES = 16;            // output channels per 512-bit register
constexpr int HALF_BYTES = 256;      // one group of 16 channels: 16 x 32 nibbles
constexpr int GROUP_BYTES = 512;     // one group of a block of 32 channels
constexpr int MAX_TILE = 8;          // rows multiplied per pass over a block's weights
constexpr int PREFETCH = 2048;       // bytes of weights ahead of the group being multiplied

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Quantise each row to int8 (symmetric, per row, round to nearest even, -127..127), x ~ xs * xq,
// and sum each group's codes: a group's minimum term is min * sum(xq over the group). Taking the
// sum of the codes, not of x, makes the result exactly xs * (W . xq): the minimums cancel inside
// each weight instead of adding the activations' rounding error times a large minimum.
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int8_t* xq, float* xs, float* code_sums) {
  const int64_t groups = k / GROUP;
  const __m512 limit = _mm512_set1_ps(127.f);
  for (int64_t r = 0; r < m; ++r) {
    const T* row = x + r * k;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(row + i)));
    const float top = _mm512_reduce_max_ps(amax);
    const float scale = top > 0.f ? top / 127.f : 1.f;
    const __m512 inv = _mm512_set1_ps(1.f / scale);
    xs[r] = scale;
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 a = load16(row + g * GROUP), b = load16(row + g * GROUP + 16);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(a, inv), -limit), limit));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(b, inv), -limit), limit));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * k + g * GROUP), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * k + g * GROUP + 16), _mm512_cvtsepi32_epi8(qb));
      code_sums[r * groups + g] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
    }
  }
}

inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

constexpr int SUPER = 8;                       // groups per superblock (GGUF Q4_K: 256 inputs)
constexpr int HEADER_BYTES = 128;              // a superblock's d and dmin, fp16, 32 channels each
constexpr int GROUP_LINE = 64;                 // a group's 6-bit scale and minimum codes, uint8, 32 channels each
constexpr int STRIDE = GROUP_LINE + GROUP_BYTES;
constexpr int SUPER_BYTES = HEADER_BYTES + SUPER * STRIDE;

inline __m512 codes16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline int64_t block_bytes(int64_t groups) {
  return (groups / SUPER) * SUPER_BYTES + (groups % SUPER ? HEADER_BYTES + (groups % SUPER) * STRIDE : 0);
}

// One block of 32 output channels (two registers of 16) for TILE rows. Per row and channel the
// integer dot of each group is exact and the float steps come in one fixed order, so a row's
// result does not depend on the tile it was computed in (row-exact). d * sc is exact in fp32
// (11 by 6 bits), so the weights are exactly the file's.
template <int TILE>
void run_tile(const uint8_t* w, int64_t groups, const int8_t* xq, const float* xs, const float* code_sums, int64_t k,
              float* y, int64_t n, int64_t block) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[TILE][2];
  for (int r = 0; r < TILE; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t s0 = 0; s0 < groups; s0 += SUPER) {
    const uint8_t* sb = w + (s0 / SUPER) * SUPER_BYTES;
    const at::Half* hd = reinterpret_cast<const at::Half*>(sb);
    const __m512 da = load_half16(hd), db = load_half16(hd + LANES);
    const __m512 ma = load_half16(hd + 2 * LANES), mb = load_half16(hd + 3 * LANES);
    const int64_t count = std::min<int64_t>(SUPER, groups - s0);
    for (int64_t gi = 0; gi < count; ++gi) {
      const int64_t g = s0 + gi;
      const uint8_t* line = sb + HEADER_BYTES + gi * STRIDE;
      const uint8_t* wg = line + GROUP_LINE;
      // the stream ahead, headers included (the lines between two groups' windows at a superblock's start)
      for (int off = 0; off < STRIDE + HEADER_BYTES; off += 64) _mm_prefetch(reinterpret_cast<const char*>(line + PREFETCH + off), _MM_HINT_T0);
      __m512i dot[TILE][2];
      for (int r = 0; r < TILE; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i pa = _mm512_loadu_si512(wg + c * 64);
        const __m512i pb = _mm512_loadu_si512(wg + HALF_BYTES + c * 64);
        const __m512i loa = _mm512_and_si512(pa, low), hia = _mm512_and_si512(_mm512_srli_epi16(pa, 4), low);
        const __m512i lob = _mm512_and_si512(pb, low), hib = _mm512_and_si512(_mm512_srli_epi16(pb, 4), low);
        for (int r = 0; r < TILE; ++r) {
          const int8_t* xr = xq + r * k + g * GROUP + c * 8;
          const __m512i xl = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr));
          const __m512i xh = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 4));
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], loa, xl);
          dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], lob, xl);
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], hia, xh);
          dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], hib, xh);
        }
      }
      const __m512 sca = _mm512_mul_ps(codes16(line), da), scb = _mm512_mul_ps(codes16(line + LANES), db);
      const __m512 mna = _mm512_mul_ps(codes16(line + 2 * LANES), ma), mnb = _mm512_mul_ps(codes16(line + 3 * LANES), mb);
      for (int r = 0; r < TILE; ++r) {
        const __m512 sums = _mm512_set1_ps(code_sums[r * groups + g]);
        acc[r][0] = _mm512_fnmadd_ps(mna, sums, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][0]), sca, acc[r][0]));
        acc[r][1] = _mm512_fnmadd_ps(mnb, sums, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][1]), scb, acc[r][1]));
      }
    }
  }
  for (int r = 0; r < TILE; ++r) {
    const __m512 scale = _mm512_set1_ps(xs[r]);
    _mm512_storeu_ps(y + r * n + block * 2 * LANES, _mm512_mul_ps(acc[r][0], scale));
    _mm512_storeu_ps(y + r * n + block * 2 * LANES + LANES, _mm512_mul_ps(acc[r][1], scale));
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const float*, int64_t, float*, int64_t,
                       int64_t);
const TileFn TILES[MAX_TILE + 1] = {nullptr,       run_tile<1>, run_tile<2>, run_tile<3>, run_tile<4>,
                                   run_tile<5>, run_tile<6>, run_tile<7>, run_tile<8>};

}  // namespace

// x [M, K] (fp32 or bf16), packed [N/32, block_bytes(K/32)] uint8 (see w4a8.pack_q4), bias [N] fp32
// or empty -> [M, N] in x's dtype.
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "q4_linear: x must be a contiguous [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1), groups = k / GROUP;
  TORCH_CHECK(k % GROUP == 0 && packed.dim() == 2 && packed.is_contiguous() && packed.size(1) == block_bytes(groups),
              "q4_linear: packed must be [N/32, block_bytes(K/32)] for this K");
  const int64_t blocks = packed.size(0), n = blocks * 2 * LANES, stride = packed.size(1);
  std::vector<int8_t> xq(m * k);
  std::vector<float> xs(m), code_sums(m * groups);
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), m, k, xq.data(), xs.data(), code_sums.data());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "q4_linear: x must be fp32 or bf16");
    quantize_rows(x.data_ptr<at::BFloat16>(), m, k, xq.data(), xs.data(), code_sums.data());
  }
  auto y = torch::empty({m, n}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r = 0; r < m; r += MAX_TILE) {
        const int tile = static_cast<int>(std::min<int64_t>(MAX_TILE, m - r));
        TILES[tile](wp + b * stride, groups, xq.data() + r * k, xs.data() + r, code_sums.data() + r * groups, k,
                    yp + r * n, n, b);
      }
    }
  });
  if (bias.defined() && bias.numel() > 0) y.add_(bias);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_linear", &q4_linear, "W4A8 linear (AVX512-VNNI)");
  mod.def("block_bytes", &block_bytes, "bytes of one block of 32 output channels for K/32 groups");
}
