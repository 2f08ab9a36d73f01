// Paged attention for the CPU, one query token per row, reading the K/V pages where they lie
// (pallas_kernels/cpu_kernel.py builds and registers it; reference.py calls it for decode-like
// token blocks). XLA:CPU runs the reference's page gather on one thread and copies every key
// block before its product; this reads each written slot once, rows x KV heads split over
// `threads` threads. float32 only.
//
//   q      f32[T, Hq, D]            one query per row
//   k, v   f32[Hkv, P, S, D]        the pools (page_size S)
//   rows   s32[T, W]                each row's page-table row
//   starts s32[T], ends s32[T]      the keys [start, end) row t sees (end 0: padding, zeros)
//   out    f32[T, Hq, D]
//
// Per row and KV head: an online softmax over the keys page by page (scores of the head's
// G = Hq / Hkv queries, soft cap c: c * tanh(s / c) when c > 0).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxGroup = 32;
constexpr int64_t kMaxDim = 512;
constexpr int64_t kMaxPage = 256;

struct Shapes {
  int64_t t, hq, d, hkv, p, s, w, g;
};

void Attend(const Shapes& n, const float* q, const float* k, const float* v, const int32_t* rows,
            const int32_t* starts, const int32_t* ends, float scale, float cap, float* out,
            int64_t item) {
  const int64_t row = item / n.hkv, h = item % n.hkv;
  const int64_t end = std::min<int64_t>(ends[row], n.w * n.s);
  const int64_t start = std::max<int64_t>(starts[row], 0);
  float m[kMaxGroup], l[kMaxGroup], acc[kMaxGroup * kMaxDim], s[kMaxPage];
  std::fill(m, m + n.g, -INFINITY);
  std::fill(l, l + n.g, 0.f);
  std::fill(acc, acc + n.g * n.d, 0.f);
  const float* qrow = q + (row * n.hq + h * n.g) * n.d;
  for (int64_t p0 = start - start % n.s; p0 < end; p0 += n.s) {
    const int64_t page = rows[row * n.w + p0 / n.s];
    const int64_t lo = std::max<int64_t>(start - p0, 0), hi = std::min<int64_t>(n.s, end - p0);
    const float* kp = k + ((h * n.p + page) * n.s) * n.d;
    const float* vp = v + ((h * n.p + page) * n.s) * n.d;
    for (int64_t g = 0; g < n.g; ++g) {
      const float* qg = qrow + g * n.d;
      float mx = m[g];
      for (int64_t j = lo; j < hi; ++j) {
        const float* kj = kp + j * n.d;
        float dot = 0.f;
        for (int64_t d = 0; d < n.d; ++d) dot += qg[d] * kj[d];
        float x = dot * scale;
        if (cap > 0.f) x = cap * std::tanh(x / cap);
        s[j] = x;
        mx = std::max(mx, x);
      }
      const float corr = std::exp(m[g] - mx);
      float sum = l[g] * corr;
      float* a = acc + g * n.d;
      for (int64_t d = 0; d < n.d; ++d) a[d] *= corr;
      for (int64_t j = lo; j < hi; ++j) {
        const float pj = std::exp(s[j] - mx);
        sum += pj;
        const float* vj = vp + j * n.d;
        for (int64_t d = 0; d < n.d; ++d) a[d] += pj * vj[d];
      }
      m[g] = mx;
      l[g] = sum;
    }
  }
  for (int64_t g = 0; g < n.g; ++g) {
    float* o = out + (row * n.hq + h * n.g + g) * n.d;
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t d = 0; d < n.d; ++d) o[d] = acc[g * n.d + d] * inv;
  }
}

ffi::Error Impl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> starts,
                ffi::Buffer<ffi::S32> ends, float sm_scale, float soft_cap, int64_t threads,
                ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto rd = rows.dimensions();
  auto vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || rd.size() != 2 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin())) {
    return ffi::Error::InvalidArgument("paged attention: unexpected ranks or shapes");
  }
  Shapes n{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], rd[1], 0};
  if (n.hkv == 0 || n.hq % n.hkv || kd[3] != n.d || rd[0] != n.t) {
    return ffi::Error::InvalidArgument("paged attention: shapes do not agree");
  }
  n.g = n.hq / n.hkv;
  if (n.g > kMaxGroup || n.d > kMaxDim || n.s > kMaxPage) {
    return ffi::Error::InvalidArgument("paged attention: group, head_dim or page too large");
  }
  const int64_t items = n.t * n.hkv;
  auto work = [&](int64_t first, int64_t step) {
    for (int64_t i = first; i < items; i += step) {
      Attend(n, q.typed_data(), k.typed_data(), v.typed_data(), rows.typed_data(),
             starts.typed_data(), ends.typed_data(), sm_scale, soft_cap, out->typed_data(), i);
    }
  };
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < nt; ++i) pool.emplace_back(work, i, nt);
  work(0, nt);
  for (auto& th : pool) th.join();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedCpuPagedAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("threads")
                                  .Ret<ffi::Buffer<ffi::F32>>());
