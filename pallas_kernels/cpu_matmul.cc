// Matrix products for the CPU against weights packed in panels of 64 columns
// (pallas_kernels/cpu_kernel.py builds and registers it, and packs the weights;
// models/packed.py calls it). XLA:CPU's products of a decode step's few rows run at about
// 60-70% of the cores' FMA peak; reading each panel's K x 64 block contiguously, six rows at
// a time with 24 accumulators, runs them 15-40% faster and large products as fast. Six rows,
// not eight: 32 accumulators and the panel's 4 vectors are more than AVX-512's 32 registers,
// and the spilled accumulators held an Intel core with two FMA units at 52-61% of its peak
// (6 rows: 80%; docs/benchmarks.md).
//
//   x       f32[M, K]          rows
//   panels  f32[P, K, 64]      w [K, N] as panels: panels[p, k, j] = w[k, 64 p + j], N = 64 P
//   valid   s32[]              rows that matter: the first min(max(valid, 0), M) (a step's
//                              real tokens before its bucket's padding); the rest are zeros
//                              in out, not computed
//   out     f32[M, N]          x @ w
//
// Items (panel, block of up to 240 rows) are shared by this thread and XLA's intra-op pool
// (cpu_pool.h). Each output is one sum over k in order, in float32.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "cpu_math.h"
#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jpaged::Load16;
using jpaged::Store16;
using jpaged::V16;

constexpr int64_t kPanel = 64;
constexpr int64_t kTileRows = 6;
constexpr int64_t kRowBlock = 40 * kTileRows;

// out[m0 .. m0 + kRows, 64 p .. 64 p + 64) = x[m0 .. m0 + kRows) @ panel p. Where ahead is
// set, each k step also fetches `per` cache lines from ahead on into L2 (Ahead below).
template <int kRows>
inline void Tile(const float* x, const float* panel, float* out, int64_t k, int64_t n,
                 int64_t m0, int64_t col, const char* ahead, int64_t per) {
  V16 acc[kRows][4];
  for (int i = 0; i < kRows; ++i) {
    for (int j = 0; j < 4; ++j) acc[i][j] = V16{};
  }
  const float* xr = x + m0 * k;
  for (int64_t t = 0; t < k; ++t) {
    const float* w = panel + t * kPanel;
    if (ahead != nullptr) {
      for (int64_t l = 0; l < per; ++l) __builtin_prefetch(ahead + (t * per + l) * 64, 0, 2);
    }
    const V16 b0 = Load16(w), b1 = Load16(w + 16), b2 = Load16(w + 32), b3 = Load16(w + 48);
    for (int i = 0; i < kRows; ++i) {
      const float a = xr[i * k + t];
      acc[i][0] += a * b0;
      acc[i][1] += a * b1;
      acc[i][2] += a * b2;
      acc[i][3] += a * b3;
    }
  }
  for (int i = 0; i < kRows; ++i) {
    for (int j = 0; j < 4; ++j) Store16(out + (m0 + i) * n + col + 16 * j, acc[i][j]);
  }
}

// A decode step's product reads each panel from memory in its first tile and from L2 in the
// others: the memory waits, then the cores compute. While one item's tiles run, Ahead spreads
// the fetch of the panel this thread likely takes next (items alternate between the threads
// from the shared counter: `threads` on) over them, so the next first tile finds it in L2.
// Only for one block of 3 rows or more: two blocks' next items share a panel, and one or two
// rows are a stream the hardware prefetcher keeps up with (Intel Xeon, 30 layers of SmolLM2's
// products, 2 threads: 3-32 rows 8-20% less time, 1-2 rows the same or up to 5% more).
struct Ahead {
  const char* panel;  // the next panel (k rows of 4 cache lines), or nullptr: none
  int64_t k, per;     // its rows; lines fetched per k step (1, 2 or 4)
  // Tile j's start in the next panel (its k * per lines follow), or nullptr where the
  // earlier tiles fetched it all: every tile's share ends on a panel row.
  const char* For(int64_t j) const {
    return panel != nullptr && j * per < 4 ? panel + j * per * k * 64 : nullptr;
  }
};

ffi::Error Impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                ffi::Buffer<ffi::S32> valid, int64_t threads, ffi::ThreadPool pool,
                ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto pd = panels.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[2] != kPanel || pd[1] != xd[1] ||
      od.size() != 2 || od[0] != xd[0] || od[1] != pd[0] * kPanel ||
      valid.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "matmul: x [M, K], panels [N / 64, K, 64], valid [], out [M, N]");
  }
  // Items (panel, block of rows) over this thread and XLA's pool (cpu_pool.h).
  const float *xp = x.typed_data(), *pp = panels.typed_data();
  float* op = out->typed_data();
  const int64_t k = xd[1], n = od[1];
  const int64_t m = std::clamp<int64_t>(valid.typed_data()[0], 0, xd[0]);
  std::memset(op + m * n, 0, sizeof(float) * (xd[0] - m) * n);
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  jpaged::ParallelFor(pool, threads, pd[0] * blocks, [=] {
    return [=](int64_t i) {
      const int64_t p = i / blocks, m0 = (i % blocks) * kRowBlock;
      const int64_t m1 = std::min(m, m0 + kRowBlock);
      const float* panel = pp + p * k * kPanel;
      const int64_t col = p * kPanel, tiles = (m1 - m0 + kTileRows - 1) / kTileRows;
      const int64_t next = p + threads;
      const Ahead ahead{blocks == 1 && m1 - m0 >= 3 && next < pd[0]
                            ? reinterpret_cast<const char*>(pp + next * k * kPanel) : nullptr,
                        k, tiles >= 4 ? 1 : tiles >= 2 ? 2 : 4};
      int64_t r = m0, j = 0;
      for (; r + kTileRows <= m1; r += kTileRows, ++j) {
        Tile<kTileRows>(xp, panel, op, k, n, r, col, ahead.For(j), ahead.per);
      }
      const char* last = ahead.For(j);
      switch (m1 - r) {  // the last 1-5 rows as one tile: each tile reads the whole panel
        case 5: Tile<5>(xp, panel, op, k, n, r, col, last, ahead.per); break;
        case 4: Tile<4>(xp, panel, op, k, n, r, col, last, ahead.per); break;
        case 3: Tile<3>(xp, panel, op, k, n, r, col, last, ahead.per); break;
        case 2: Tile<2>(xp, panel, op, k, n, r, col, last, ahead.per); break;
        case 1: Tile<1>(xp, panel, op, k, n, r, col, last, ahead.per); break;
        default: break;
      }
    };
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedCpuMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
