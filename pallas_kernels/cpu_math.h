// Vector helpers shared by the CPU kernels (cpu_paged_attention.cc, cpu_sampling.cc,
// cpu_matmul.cc).
//
// V16: 16 floats as one vector (GCC's vector extension: one AVX-512 register, or two AVX2).
// Load16 / Store16: unaligned, aliasing access through V16u; loads and stores through it keep
// accumulators in registers (a memcpy into a V16 array made GCC spill them every step).
// Exp: exp(x) for x <= 0 (a value less its row's maximum), written so the loops calling it
// vectorize: x = k ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r (about 1 ulp), 2^k
// from the exponent bits. Below -87.3 (e^x under float32's normal range) it gives 2^-126.
#ifndef JPAGED_CPU_MATH_H_
#define JPAGED_CPU_MATH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace jpaged {

typedef float V16 __attribute__((vector_size(64)));
typedef float V16u __attribute__((vector_size(64), aligned(4), may_alias));

inline V16 Load16(const float* p) { return *reinterpret_cast<const V16u*>(p); }
inline void Store16(float* p, V16 v) { *reinterpret_cast<V16u*>(p) = v; }

inline float Exp(float x) {
  x = std::max(x, -87.3f);
  const float kf = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - kf * 0.693359375f) + kf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(kf) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace jpaged

#endif  // JPAGED_CPU_MATH_H_
