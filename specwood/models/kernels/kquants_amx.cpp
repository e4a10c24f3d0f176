// The k-quant linears of kquants_vnni.cpp on AMX tiles (Intel Sapphire Rapids and later), for calls
// with many rows (trees, batches, prefill), where the VNNI kernel's cost grows with the rows.
//
// One tile multiply (tdpbsud: signed int8 activations by unsigned int8 codes, int32 sums) takes 16
// rows' activations of one group (A: 16 rows x 32 bytes) by one half-block's codes (B: 8 rows of 16
// channels x 4 inputs, the very layout kquants_common.h's chunks give a VNNI register) and leaves
// the 16 rows' integer dots of 16 channels (C: 16 x 16 int32). The codes are unpacked once per group
// (into two 512-byte staging buffers, not a second copy of the weights) and serve every row tile.
// The dots are exact in int32 whichever unit summed them, and each row's dots are closed by
// kquants_common.h's float epilogues in the same order as the VNNI kernel's, so a row gets the same
// bits from either kernel and from any number of rows (trees and batches stay lossless).
//
// SPECWOOD_TILE_EMULATION builds the same kernel over a plain C++ model of the tile unit (what
// tileloadd / tilestored / tilezero / tdpbsud do, as Intel's manual defines them), so its layouts
// and epilogues are tested on CPUs without AMX; the real build differs only in the six tile macros.
#include <ATen/Parallel.h>

#include "kquants_common.h"

#ifndef SPECWOOD_TILE_EMULATION
#include <sys/syscall.h>
#include <unistd.h>
#include <cerrno>
#endif

namespace {

constexpr int TILE_ROWS = 16;  // activation rows per tile multiply
constexpr int HALF_TILE = 0, HALF_TILE_B = 1, ACT_TILE = 2, CODES_A = 3, CODES_B = 4;

// ldtilecfg's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The shapes for dots closed every `k_bytes` inputs (32: Q4_K, Q5_K, Q8_0 groups; 16: Q6_K's
// sub-blocks): two int32 accumulators, the activations, the two halves' codes.
TileConfig tile_config(int k_bytes) {
  TileConfig cfg;
  for (int t : {HALF_TILE, HALF_TILE_B}) cfg.rows[t] = TILE_ROWS, cfg.colsb[t] = LANES * 4;
  cfg.rows[ACT_TILE] = TILE_ROWS, cfg.colsb[ACT_TILE] = k_bytes;
  for (int t : {CODES_A, CODES_B}) cfg.rows[t] = k_bytes / 4, cfg.colsb[t] = LANES * 4;
  return cfg;
}

#ifdef SPECWOOD_TILE_EMULATION
struct EmulatedTile {
  int rows = 0, colsb = 0;
  alignas(64) uint8_t data[16][64] = {};
};
thread_local EmulatedTile tiles[8];

// The checks the hardware makes (it faults where these fail), so that a shape mistake fails here too.
void tile_configure(const TileConfig& cfg) {
  TORCH_CHECK(cfg.palette == 1 && cfg.start_row == 0, "tile config: palette 1, start row 0");
  for (int t = 0; t < 8; ++t) {
    TORCH_CHECK(cfg.rows[t] <= 16 && cfg.colsb[t] <= 64 && cfg.colsb[t] % 4 == 0 && (cfg.rows[t] == 0) == (cfg.colsb[t] == 0),
                "tile config: tile ", t, " has ", int(cfg.rows[t]), " rows of ", int(cfg.colsb[t]), " bytes");
    tiles[t].rows = cfg.rows[t], tiles[t].colsb = cfg.colsb[t];
  }
}
void tile_release() {
  for (auto& t : tiles) t = EmulatedTile{};
}
void tile_load(int t, const void* base, int64_t stride) {
  TORCH_CHECK(tiles[t].rows > 0, "tileloadd of unconfigured tile ", t);
  for (int r = 0; r < tiles[t].rows; ++r)
    std::memcpy(tiles[t].data[r], static_cast<const uint8_t*>(base) + r * stride, tiles[t].colsb);
}
void tile_store(int t, void* base, int64_t stride) {
  TORCH_CHECK(tiles[t].rows > 0, "tilestored of unconfigured tile ", t);
  for (int r = 0; r < tiles[t].rows; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, tiles[t].data[r], tiles[t].colsb);
}
void tile_zero(int t) { std::memset(tiles[t].data, 0, sizeof(tiles[t].data)); }
// tdpbsud: C[m][n] += sum over k of int8(A[m][k]) * uint8(B[k / 4][4 n + k % 4]), in int32.
void tile_dpbsud(int c, int a, int b) {
  EmulatedTile &C = tiles[c], &A = tiles[a], &B = tiles[b];
  TORCH_CHECK(c != a && c != b && a != b && C.rows > 0 && C.rows == A.rows && A.colsb == 4 * B.rows &&
              C.colsb == B.colsb, "tdpbsud: tiles ", c, ", ", a, ", ", b, " do not fit together");
  for (int m = 0; m < C.rows; ++m)
    for (int n = 0; n < C.colsb / 4; ++n) {
      int32_t sum;
      std::memcpy(&sum, C.data[m] + 4 * n, 4);
      for (int k = 0; k < A.colsb; ++k)
        sum += static_cast<int32_t>(static_cast<int8_t>(A.data[m][k])) * static_cast<int32_t>(B.data[k / 4][4 * n + k % 4]);
      std::memcpy(C.data[m] + 4 * n, &sum, 4);
    }
}
#define TILE_LOAD(t, base, stride) tile_load(t, base, stride)
#define TILE_STORE(t, base, stride) tile_store(t, base, stride)
#define TILE_ZERO(t) tile_zero(t)
#define TILE_DP(c, a, b) tile_dpbsud(c, a, b)
constexpr bool EMULATED = true;
#else
// GCC's tile loads are asm statements that do not tell the compiler they read memory: without the
// barriers it may drop or sink the stores that stage the codes, or move the next group's staging
// stores above this load.
#define MEMORY_BARRIER() __asm__ volatile("" ::: "memory")
void tile_configure(const TileConfig& cfg) {
  MEMORY_BARRIER();
  _tile_loadconfig(&cfg);
}
void tile_release() { _tile_release(); }
// The intrinsics take tile numbers as literal tokens, so the calls below spell tiles 0-4 out.
#define TILE_LOAD(t, base, stride) \
  do {                             \
    MEMORY_BARRIER();              \
    _tile_loadd(t, base, stride);  \
    MEMORY_BARRIER();              \
  } while (0)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DP(c, a, b) _tile_dpbsud(c, a, b)
constexpr bool EMULATED = false;
#endif
static_assert(HALF_TILE == 0 && HALF_TILE_B == 1 && ACT_TILE == 2 && CODES_A == 3 && CODES_B == 4,
              "the tile macros below name tiles 0-4 literally");

// One group's (or Q6_K sub-block's) dots for one row tile: the codes already in tiles 3 and 4,
// the activations from `x` (row stride k). `dots` gets [16 rows][2 halves x 16 channels] int32.
inline void row_tile_dots(const int8_t* x, int64_t k, int32_t (*dots)[2 * LANES]) {
  TILE_ZERO(0);
  TILE_ZERO(1);
  TILE_LOAD(2, x, k);
  TILE_DP(0, 2, 3);
  TILE_DP(1, 2, 4);
  TILE_STORE(0, dots, 2 * LANES * 4);
  TILE_STORE(1, dots[0] + LANES, 2 * LANES * 4);
}

inline void load_dot(const int32_t* row, __m512i (&dot)[2]) {
  dot[0] = _mm512_loadu_si512(row);
  dot[1] = _mm512_loadu_si512(row + LANES);
}
inline void load_acc(const float* row, __m512 (&acc)[2]) {
  acc[0] = _mm512_loadu_ps(row);
  acc[1] = _mm512_loadu_ps(row + LANES);
}
inline void store_acc(float* row, const __m512 (&acc)[2]) {
  _mm512_storeu_ps(row, acc[0]);
  _mm512_storeu_ps(row + LANES, acc[1]);
}

// Stage a chunk's unpacked codes as tile rows: inputs 8c..8c+3 in row 2c, 8c+4..8c+7 in row 2c+1.
inline void stage(const Chunk& u, int row, uint8_t (*codes_a)[64], uint8_t (*codes_b)[64]) {
  _mm512_store_si512(codes_a[row], u.lo_a);
  _mm512_store_si512(codes_a[row + 1], u.hi_a);
  _mm512_store_si512(codes_b[row], u.lo_b);
  _mm512_store_si512(codes_b[row + 1], u.hi_b);
}

// What one call shares with its block functions: the activations (codes padded to whole row
// tiles), the rows, and per block an fp32 accumulator of [rows][32 channels].
struct Call {
  const Activations& a;
  int64_t m;
  float* acc;  // [m, 32] of the block being computed
};

// Every row tile's dots of one group (or sub-block: the activations at `offset` in each row) with
// the codes in tiles 3 and 4, each row's closed into its accumulator by close(acc, dot, row).
template <typename Close>
inline void close_rows(const Call& call, int64_t offset, Close&& close) {
  alignas(64) int32_t dots[TILE_ROWS][2 * LANES];
  const int64_t k = call.a.k;
  for (int64_t r0 = 0; r0 < call.m; r0 += TILE_ROWS) {
    row_tile_dots(call.a.q.data() + r0 * k + offset, k, dots);
    for (int64_t r = r0; r < std::min<int64_t>(call.m, r0 + TILE_ROWS); ++r) {
      __m512i dot[2];
      __m512 acc[2];
      load_dot(dots[r - r0], dot);
      load_acc(call.acc + r * 2 * LANES, acc);
      close(acc, dot, r);
      store_acc(call.acc + r * 2 * LANES, acc);
    }
  }
}

// Q4_K (Q5_K with FIFTH) for one block of 32 output channels, every row.
template <bool FIFTH>
void q4_block(const uint8_t* w, const Call& call) {
  const Activations& a = call.a;
  const int64_t groups = a.groups;
  using L = std::conditional_t<FIFTH, Q5Layout, Q4Layout>;
  alignas(64) uint8_t codes_a[8][64], codes_b[8][64];
  for (int64_t s0 = 0; s0 < groups; s0 += SUPER) {
    const uint8_t* sb = w + (s0 / SUPER) * L::super_bytes;
    const at::Half* hd = reinterpret_cast<const at::Half*>(sb);
    const __m512 da = load_half16(hd), db = load_half16(hd + LANES);
    const __m512 ma = load_half16(hd + 2 * LANES), mb = load_half16(hd + 3 * LANES);
    const int64_t count = std::min<int64_t>(SUPER, groups - s0);
    for (int64_t gi = 0; gi < count; ++gi) {
      const int64_t g = s0 + gi;
      const uint8_t* line = sb + L::header + gi * L::stride;
      prefetch(line, L::stride + L::header);
      for (int c = 0; c < 4; ++c) stage(q4_chunk<FIFTH>(line + 64, c), 2 * c, codes_a, codes_b);
      TILE_LOAD(3, codes_a, 64);
      TILE_LOAD(4, codes_b, 64);
      const __m512 sca = _mm512_mul_ps(ucodes16(line), da), scb = _mm512_mul_ps(ucodes16(line + LANES), db);
      const __m512 mna = _mm512_mul_ps(ucodes16(line + 2 * LANES), ma), mnb = _mm512_mul_ps(ucodes16(line + 3 * LANES), mb);
      close_rows(call, g * GROUP, [&](__m512(&acc)[2], const __m512i(&dot)[2], int64_t r) {
        add_min_dot(acc, dot, a.sums16[r * 2 * groups + 2 * g] + a.sums16[r * 2 * groups + 2 * g + 1], sca, scb, mna,
                    mnb, a.scale[r * groups + g]);
      });
    }
  }
}

// Q6_K: per sub-block of 16 inputs, two chunks of codes, dots closed with the -32 offset.
void q6_block(const uint8_t* w, const Call& call) {
  const Activations& a = call.a;
  const int64_t groups = a.groups;
  alignas(64) uint8_t codes_a[4][64], codes_b[4][64];
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
        const __m512i ha = _mm512_loadu_si512(bits + s * 64), hb = _mm512_loadu_si512(bits + 128 + s * 64);
        for (int cc = 0; cc < 2; ++cc) stage(q6_chunk(wg, ha, hb, 2 * s + cc, cc), 2 * cc, codes_a, codes_b);
        TILE_LOAD(3, codes_a, 64);
        TILE_LOAD(4, codes_b, 64);
        const __m512 sca = _mm512_mul_ps(scodes16(line + s * 32), da);
        const __m512 scb = _mm512_mul_ps(scodes16(line + s * 32 + LANES), db);
        close_rows(call, g * GROUP + s * 16, [&](__m512(&acc)[2], const __m512i(&dot)[2], int64_t r) {
          add_offset_dot(acc, dot, 32 * a.sums16[r * 2 * groups + 2 * g + s], sca, scb, a.scale[r * groups + g]);
        });
      }
    }
  }
}

// Q8_0: the codes + 128 are already tile rows (chunk c: 16 channels x inputs 4c..4c+3), so the
// tiles load straight from the weights.
void q8_block(const uint8_t* w, const Call& call) {
  const Activations& a = call.a;
  const int64_t groups = a.groups;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* line = w + g * Q8Layout::stride;
    prefetch(line, Q8Layout::stride, Q8_PREFETCH);
    TILE_LOAD(3, line + 64, 64);
    TILE_LOAD(4, line + 64 + GROUP_BYTES, 64);
    const at::Half* hd = reinterpret_cast<const at::Half*>(line);
    const __m512 da = load_half16(hd), db = load_half16(hd + LANES);
    close_rows(call, g * GROUP, [&](__m512(&acc)[2], const __m512i(&dot)[2], int64_t r) {
      add_offset_dot(acc, dot, 128 * (a.sums16[r * 2 * groups + 2 * g] + a.sums16[r * 2 * groups + 2 * g + 1]), da, db,
                     a.scale[r * groups + g]);
    });
  }
}

using BlockFn = void (*)(const uint8_t*, const Call&);

// x [M, K] (fp32 or bf16), packed [N/32, block_bytes] uint8, bias [N] fp32 or empty -> [M, N] in x's dtype.
torch::Tensor run_linear(BlockFn block_fn, int k_bytes, int64_t (*block_bytes)(int64_t), const char* name,
                         torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  const LinearShape s = check_linear(name, x, packed, block_bytes);
  const Activations a = quantize(x, TILE_ROWS);
  auto y = torch::empty({s.m, s.n}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const TileConfig cfg = tile_config(k_bytes);
  at::parallel_for(0, s.blocks, 4, [&](int64_t b0, int64_t b1) {
    tile_configure(cfg);  // per thread: the tile state is a thread's own
    std::vector<float> acc(s.m * 2 * LANES);
    for (int64_t b = b0; b < b1; ++b) {
      std::fill(acc.begin(), acc.end(), 0.f);
      block_fn(wp + b * s.stride, Call{a, s.m, acc.data()});
      for (int64_t r = 0; r < s.m; ++r)
        std::memcpy(yp + r * s.n + b * 2 * LANES, acc.data() + r * 2 * LANES, 2 * LANES * 4);
    }
    tile_release();
  });
  return finish_linear(y, x, bias);
}

// The OS's permission to use tile data (Linux 5.16+: arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA), once per process): 0, or the errno of the refusal.
int request_tile_permission() {
#ifdef SPECWOOD_TILE_EMULATION
  return 0;
#else
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : errno;
#endif
}

}  // namespace

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  return run_linear(q4_block<false>, GROUP, Q4Layout::block_bytes, "q4_linear", x, packed, bias);
}

torch::Tensor q5_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  return run_linear(q4_block<true>, GROUP, Q5Layout::block_bytes, "q5_linear", x, packed, bias);
}

torch::Tensor q6_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  return run_linear(q6_block, 16, Q6Layout::block_bytes, "q6_linear", x, packed, bias);
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  return run_linear(q8_block, GROUP, Q8Layout::block_bytes, "q8_linear", x, packed, bias);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_linear", &q4_linear, "Q4_K weights x int8 activations (AMX tiles)");
  mod.def("q5_linear", &q5_linear, "Q5_K weights x int8 activations (AMX tiles)");
  mod.def("q6_linear", &q6_linear, "Q6_K weights x int8 activations (AMX tiles)");
  mod.def("q8_linear", &q8_linear, "Q8_0 weights x int8 activations (AMX tiles)");
  mod.def("request_tile_permission", &request_tile_permission,
          "ask Linux for this process's AMX tile data: 0, or the errno of the refusal");
  mod.attr("emulated") = EMULATED;
}
