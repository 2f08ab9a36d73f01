// The vocabulary passes of sampling for the CPU (pallas_kernels/cpu_kernel.py builds and
// registers it; jpaged/sample/sampler.py calls it). XLA:CPU runs each reduction over a step's
// [S, V] logits on one thread, in several passes; this makes them in two passes per row,
// rows over XLA's intra-op pool.
//
//   logits f32[S, V]   the logits tokens are picked from (after bias and bans)
//   model  f32[S, V]   the model's logits, which log-probabilities are taken of
//   argmax s32[S]      the first maximum of each logits row, or its first NaN if it has one
//   x_max  f32[S]      the maximum of each model row's numbers (NaN entries passed over)
//   lse    f32[S]      log(sum(exp(model - x_max))) of each row: NaN when the row has a NaN
//                      or x_max is not finite, as the jnp form gives
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

#include "cpu_math.h"
#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jpaged::Exp;

void Row(const float* logits, const float* model, int64_t v, int32_t* argmax, float* x_max,
         float* lse) {
  float m = -INFINITY;
  bool nan = false;
  for (int64_t i = 0; i < v; ++i) {
    m = std::max(m, logits[i]);  // NaN ignored here, seen below
    nan |= logits[i] != logits[i];
  }
  int64_t first = 0;
  for (int64_t i = 0; i < v; ++i) {
    if (nan ? logits[i] != logits[i] : logits[i] == m) {
      first = i;
      break;
    }
  }
  *argmax = static_cast<int32_t>(first);
  float mm = -INFINITY;
  bool model_nan = false;
  for (int64_t i = 0; i < v; ++i) {
    mm = std::max(mm, model[i]);
    model_nan |= model[i] != model[i];
  }
  *x_max = mm;
  if (model_nan || !std::isfinite(mm)) {  // exp(x - max) has a NaN: so has their sum
    *lse = NAN;
    return;
  }
  float sum = 0.f;
  for (int64_t i = 0; i < v; ++i) sum += Exp(model[i] - mm);
  *lse = std::log(sum);
}

ffi::Error Impl(ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> model, int64_t threads,
                ffi::ThreadPool pool, ffi::ResultBuffer<ffi::S32> argmax,
                ffi::ResultBuffer<ffi::F32> x_max, ffi::ResultBuffer<ffi::F32> lse) {
  auto ld = logits.dimensions();
  auto md = model.dimensions();
  if (ld.size() != 2 || md.size() != 2 || ld[0] != md[0] || ld[1] != md[1]) {
    return ffi::Error::InvalidArgument("greedy sampling: logits and model must be [S, V]");
  }
  // Rows over this thread and XLA's pool (cpu_pool.h).
  const float *lp = logits.typed_data(), *mp = model.typed_data();
  int32_t* ap = argmax->typed_data();
  float *xp = x_max->typed_data(), *sp = lse->typed_data();
  const int64_t v = ld[1];
  jpaged::ParallelFor(pool, threads, ld[0], [=] {
    return [=](int64_t r) { Row(lp + r * v, mp + r * v, v, ap + r, xp + r, sp + r); };
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedCpuGreedy, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
