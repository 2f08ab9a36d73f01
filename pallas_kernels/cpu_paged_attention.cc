// Paged attention for the CPU, reading the K/V pages where they lie (pallas_kernels/cpu_kernel.py
// builds and registers it; reference.py calls it for every token of a float32 step on the CPU:
// prefill chunks and decode rows alike). XLA:CPU runs the reference's page gather on one thread
// and copies every key block before its product; this reads each written slot where it lies,
// tiles x KV heads split over `threads` threads. Float32 pools, or one-byte quantized ones
// (ImplQuantized: int8, fp8 e4m3 or e5m2 bytes with bfloat16 row scales, each page's rows
// dequantized as they are read).
//
//   q      f32[T, Hq, D]            query tokens
//   k, v   f32[Hkv, P, S, D]        the pools (page_size S)
//   table  s32[N, W]                the page table
//   seq    s32[T]                   each token's sequence (its row of the table)
//   starts s32[T], ends s32[T]      the keys [start, end) token t sees (end <= start: zeros)
//   sinks  f32[Hq]                  gpt-oss's sink logits, read when has_sinks
//   out    f32[T, Hq, D]
//
// A tile is up to kTile consecutive tokens of one sequence (a prefill chunk's tokens share
// their pages; a decode row is a tile of one token, served page by page by DecodePage for
// pages of 16 and head_dim 64 or 128; a tile of 16 rows or more on such pages by
// LanesPage, 16 rows as a vector's lanes). Per tile and KV head: the keys of the
// tile's union of ranges, page by page; each page's K transposed once ([D, S]) and scored
// against every query row of the tile (its tokens x the head's G = Hq / Hkv query heads);
// then per row an online softmax over its own keys of the page (soft cap c: c * tanh(s / c)
// when c > 0) and the probabilities' sum of V rows; a sink joins the denominator as one
// more key of no value (reference.py's _finish). Slots outside a row's keys are never
// read into its result (unwritten slots may hold NaN).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_math.h"
#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jpaged::Exp;
using jpaged::Load16;
using jpaged::Store16;
using jpaged::V16;

constexpr int64_t kTile = 16;
constexpr int64_t kMaxGroup = 32;
constexpr int64_t kMaxDim = 512;
constexpr int64_t kMaxPage = 256;

struct Shapes {
  int64_t t, hq, d, hkv, p, s, n, w, g;
};

struct Inputs {
  const float *q, *k, *v;  // k, v null: a quantized pool (kq, ks, vq, vs, lut)
  const int32_t *table, *seq, *starts, *ends;
  const float* sinks;  // null: none
  float scale, cap;
  float* out;
  const uint8_t *kq = nullptr, *vq = nullptr;  // [Hkv, P, S, D] bytes
  const uint16_t *ks = nullptr, *vs = nullptr;  // [Hkv, P, S] bfloat16 bits: each row's scale
  const float* lut = nullptr;                   // [256]: each byte's value
};

struct Scratch {  // one per thread; m and l over whole groups of 16 rows (LanesPage)
  std::vector<float> m, l, acc, kt, sc, kbuf, vbuf, qt, pb;
  std::vector<int64_t> st, en;
  std::vector<int32_t> rst, ren;  // each row's keys [start, end), whole groups of 16
  Scratch(const Shapes& n)
      : m(Rows16(n)), l(Rows16(n)), acc(kTile * n.g * n.d), kt(n.d * n.s),
        sc(kTile * n.g * n.s), kbuf(n.s * n.d), vbuf(n.s * n.d), qt(Rows16(n) * n.d),
        pb(256), st(kTile), en(kTile), rst(Rows16(n)), ren(Rows16(n)) {}
  static int64_t Rows16(const Shapes& n) { return (kTile * n.g + 15) / 16 * 16; }
};

// Rows [jlo, jhi) of a quantized page (bytes q [S, D], scale bits [S]) as float32 into buf:
// lut[byte] * scale (kv_quant.dequantize).
void Dequantize(const uint8_t* q, const uint16_t* scales, const float* lut, int64_t jlo,
                int64_t jhi, int64_t d, float* buf) {
  for (int64_t j = jlo; j < jhi; ++j) {
    const uint32_t bits = static_cast<uint32_t>(scales[j]) << 16;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    for (int64_t x = 0; x < d; ++x) buf[j * d + x] = lut[q[j * d + x]] * scale;
  }
}

// Scores of `rows` query rows against a page of 16 keys: kt [D, 16] (the page's K
// transposed), q_r the rows' queries, sc [rows, 16]. Eight rows at a time, each a 16-wide
// accumulator over D (independent chains, one vector of K per step of d).
template <int kRows>
inline void Scores16(const float* kt, const float* const* qr, int64_t d, float* sc) {
  V16 a[kRows];
  for (int r = 0; r < kRows; ++r) a[r] = V16{};
  for (int64_t x = 0; x < d; ++x) {
    const V16 kv = Load16(kt + x * 16);
    for (int r = 0; r < kRows; ++r) a[r] += qr[r][x] * kv;
  }
  for (int r = 0; r < kRows; ++r) Store16(sc + r * 16, a[r]);
}

// acc [16 kVecs] = acc * corr + sum over keys j in [a, b) of p[j] * V row j (rows of
// 16 kVecs floats), the accumulator held in registers over the page's keys.
template <int kVecs>
inline void Values(float* acc, float corr, const float* p, const float* vp, int64_t a,
                   int64_t b) {
  V16 o[kVecs];
  for (int x = 0; x < kVecs; ++x) {
    o[x] = Load16(acc + 16 * x) * corr;
  }
  for (int64_t j = a; j < b; ++j) {
    const float* vj = vp + j * 16 * kVecs;
    for (int x = 0; x < kVecs; ++x) {
      o[x] += p[j] * Load16(vj + 16 * x);
    }
  }
  for (int x = 0; x < kVecs; ++x) Store16(acc + 16 * x, o[x]);
}

typedef int32_t I16 __attribute__((vector_size(64)));

// The two-source lane shuffles of four stages over blocks of b = 8, 4, 2, 1 lanes: kLo[s]
// takes x's even blocks each followed by the same block of y, kHi[s] the odd ones. They
// serve a 16 x 16 transpose (Transpose16: stage s pairs rows j and j + b) and a sum of 16
// vectors' lanes (LaneSums: stage s pairs neighbouring vectors and adds the two halves).
inline constexpr I16 kLo[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                               {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                               {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                               {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
inline constexpr I16 kHi[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                               {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
                               {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
                               {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};

// r [16 rows of 16] transposed in place.
inline void Transpose16(V16* r) {
  for (int s = 0; s < 4; ++s) {
    const int b = 8 >> s;
    for (int j = 0; j < 16; ++j) {
      if (j & b) continue;
      const V16 x = r[j], y = r[j + b];
      r[j] = __builtin_shuffle(x, y, kLo[s]);
      r[j + b] = __builtin_shuffle(x, y, kHi[s]);
    }
  }
}

// Each of 16 vectors' lanes summed: lane j of the result is the sum of v[j]'s 16 lanes
// (16 -> 8 -> 4 -> 2 -> 1 vectors, each lane built from one input vector's lanes).
inline V16 LaneSums(const V16* v) {
  V16 w[16];
  for (int j = 0; j < 16; ++j) w[j] = v[j];
  for (int s = 0, n = 8; s < 4; ++s, n /= 2) {
    for (int i = 0; i < n; ++i) {
      w[i] = __builtin_shuffle(w[2 * i], w[2 * i + 1], kLo[s]) +
             __builtin_shuffle(w[2 * i], w[2 * i + 1], kHi[s]);
    }
  }
  // w[0]'s lane k holds the sum of v[bit-reversed k]; bit reversal is its own inverse.
  return __builtin_shuffle(w[0], I16{0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15});
}

// Every lane the maximum of v's 16 (butterfly: swap halves, quarters, pairs, neighbours).
inline V16 MaxAll(V16 v) {
  const I16 swaps[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                        {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                        {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                        {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
  for (const I16& swap : swaps) {
    const V16 u = __builtin_shuffle(v, swap);
    v = u > v ? u : v;
  }
  return v;
}

// The online softmax of one row over a page of 16 keys: sv its scores (scaled), keys [a, b)
// its own (soft cap c > 0: c * tanh(s / c)); pr gets e^(s - m') for them and zeros for the
// rest, m and l the new maximum and sum; returns the old terms' factor e^(m - m').
inline float Softmax16(V16 sv, int64_t a, int64_t b, float cap, float* pr, float& m,
                       float& l) {
  const I16 lane{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const auto inside = (lane >= static_cast<int32_t>(a)) & (lane < static_cast<int32_t>(b));
  if (cap > 0.f) {
    Store16(pr, sv);
    for (int j = 0; j < 16; ++j) pr[j] = cap * std::tanh(pr[j] / cap);
    sv = Load16(pr);
  }
  sv = inside ? sv : V16{} - INFINITY;
  const float mx = std::max(m, MaxAll(sv)[0]);
  Store16(pr, sv - mx);
  for (int j = 0; j < 16; ++j) pr[j] = Exp(pr[j]);
  const V16 e = inside ? Load16(pr) : V16{};
  Store16(pr, e);
  float sum = 0.f;
  for (int j = 0; j < 16; ++j) sum += e[j];
  const float corr = Exp(m - mx);
  l = l * corr + sum;
  m = mx;
  return corr;
}

// acc [kRows, 16 kVecs] = acc * corr + p @ V over the page's keys [a, b): each V row read once
// for the kRows query rows, the sums held in registers. Row r's probability of key j is
// p[r * kRowStride + j * kKeyStride] (DecodePage: by row, 16 keys a row; LanesPage: by key,
// 16 rows a key). While it runs, the next page's K and V rows (kn, vn; null: none) are fetched
// into L2, a key's rows at a time, so that they arrive while this page is computed.
template <int kVecs, int kRows, int kRowStride, int kKeyStride>
inline void RowValues(float* acc, const float* corr, const float* p, const float* vp,
                      int64_t a, int64_t b, const float* kn, const float* vn) {
  constexpr int64_t d = 16 * kVecs;
  V16 o[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int x = 0; x < kVecs; ++x) o[r][x] = Load16(acc + r * d + 16 * x) * corr[r];
  }
  for (int64_t j = a; j < b; ++j) {
    if (kn != nullptr) {
      for (int x = 0; x < kVecs; ++x) {
        __builtin_prefetch(kn + j * d + 16 * x, 0, 2);
        __builtin_prefetch(vn + j * d + 16 * x, 0, 2);
      }
    }
    V16 vj[kVecs];
    for (int x = 0; x < kVecs; ++x) vj[x] = Load16(vp + j * d + 16 * x);
    for (int r = 0; r < kRows; ++r) {
      const float pj = p[r * kRowStride + j * kKeyStride];
      for (int x = 0; x < kVecs; ++x) o[r][x] += pj * vj[x];
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int x = 0; x < kVecs; ++x) Store16(acc + r * d + 16 * x, o[r][x]);
  }
}

// RowValues for `rows` rows (acc [rows, 16 kVecs], corr [rows]), up to kChunk at a time
// (accumulators + one V row in registers: 4 rows at head_dim 64, 2 at 128); the next page
// (kn, vn) fetched once, with the first rows.
template <int kVecs, int kRowStride, int kKeyStride>
void SumValues(float* acc, const float* corr, const float* p, int64_t rows, const float* vp,
               int64_t a, int64_t b, const float* kn, const float* vn) {
  constexpr int64_t d = 16 * kVecs, kChunk = kVecs == 4 ? 4 : 2;
  for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
    float* o = acc + r0 * d;
    const float *c = corr + r0, *pr = p + r0 * kRowStride;
    switch (std::min(kChunk, rows - r0)) {
      case 4:
        RowValues<kVecs, 4, kRowStride, kKeyStride>(o, c, pr, vp, a, b, kn, vn);
        break;
      case 3:
        RowValues<kVecs, 3, kRowStride, kKeyStride>(o, c, pr, vp, a, b, kn, vn);
        break;
      case 2:
        RowValues<kVecs, 2, kRowStride, kKeyStride>(o, c, pr, vp, a, b, kn, vn);
        break;
      default:
        RowValues<kVecs, 1, kRowStride, kKeyStride>(o, c, pr, vp, a, b, kn, vn);
    }
    kn = vn = nullptr;
  }
}

// One page of 16 keys for the G query rows of one token (a decode row): scores by row
// (each key's products summed across lanes, LaneSums), an online softmax over keys [a, b),
// then the values (SumValues), which also fetches the next page (kn, vn) where there is one.
template <int kVecs>
void DecodePage(const float* const* qr, int64_t g, const float* kp, const float* vp,
                int64_t a, int64_t b, float scale, float cap, float* m, float* l, float* acc,
                float* p, const float* kn, const float* vn) {
  constexpr int64_t d = 16 * kVecs;
  float corr[kMaxGroup];
  for (int64_t r = 0; r < g; ++r) {
    V16 q[kVecs], part[16];
    for (int x = 0; x < kVecs; ++x) q[x] = Load16(qr[r] + 16 * x);
    for (int j = 0; j < 16; ++j) {
      V16 s = q[0] * Load16(kp + j * d);
      for (int x = 1; x < kVecs; ++x) s += q[x] * Load16(kp + j * d + 16 * x);
      part[j] = s;
    }
    corr[r] = Softmax16(LaneSums(part) * scale, a, b, cap, p + r * 16, m[r], l[r]);
  }
  SumValues<kVecs, 16, 1>(acc, corr, p, g, vp, a, b, kn, vn);
}

// One page of 16 keys for 16 rows of a prefill tile, the rows as the lanes of a vector (no
// work across lanes): qt [D, 16] the rows' queries transposed, rst / ren [16] each row's keys
// [start, end) (rows past nrows: empty), p0 the page's first key, [a, b) the keys any row
// of the tile sees (all written; scores of the other slots are computed but never kept).
// Scores as 16 vectors, one per key (K's elements broadcast against qt's rows); the online
// softmax per lane; then the values (SumValues).
template <int kVecs>
void LanesPage(const float* qt, const int32_t* rst, const int32_t* ren, int64_t nrows,
               int64_t p0, const float* kp, const float* vp, int64_t a, int64_t b, float scale,
               float cap, float* m, float* l, float* acc, float* pb) {
  constexpr int64_t d = 16 * kVecs;
  V16 sc[16];
  for (int j = 0; j < 16; ++j) sc[j] = V16{};
  for (int64_t x = 0; x < d; ++x) {
    const V16 q = Load16(qt + 16 * x);
    for (int j = 0; j < 16; ++j) sc[j] += kp[j * d + x] * q;
  }
  I16 st, en;
  std::memcpy(&st, rst, sizeof st);
  std::memcpy(&en, ren, sizeof en);
  const V16 m_old = Load16(m);
  V16 mx = m_old;
  I16 inside[16];
  for (int j = 0; j < 16; ++j) {
    const int32_t key = static_cast<int32_t>(p0 + j);
    inside[j] = (I16{} + key >= st) & (I16{} + key < en);  // inside [a, b) with them
    V16 x = sc[j] * scale;
    if (cap > 0.f) {
      for (int r = 0; r < 16; ++r) x[r] = cap * std::tanh(x[r] / cap);
    }
    sc[j] = inside[j] ? x : V16{} - INFINITY;
    mx = sc[j] > mx ? sc[j] : mx;
  }
  const V16 base = mx == V16{} - INFINITY ? V16{} : mx;  // a lane with no key yet: 0
  for (int j = 0; j < 16; ++j) Store16(pb + 16 * j, sc[j] - base);
  for (int i = 0; i < 256; ++i) pb[i] = Exp(pb[i]);
  V16 sum{};
  for (int j = 0; j < 16; ++j) {
    const V16 e = inside[j] ? Load16(pb + 16 * j) : V16{};
    Store16(pb + 16 * j, e);
    sum += e;
  }
  float corr[16];
  Store16(corr, m_old - base);
  for (int r = 0; r < 16; ++r) corr[r] = Exp(corr[r]);  // lanes with no key: acc, l are 0
  Store16(l, Load16(l) * Load16(corr) + sum);
  Store16(m, mx);
  SumValues<kVecs, 1, 16>(acc, corr, pb, nrows, vp, a, b, nullptr, nullptr);
}

void AttendTile(const Shapes& n, const Inputs& in, int64_t t0, int64_t cnt, int64_t h,
                Scratch& w) {
  const int64_t rows = cnt * n.g, s = n.s, d = n.d;
  const int64_t rows16 = (rows + 15) / 16 * 16;  // whole groups of 16 (LanesPage's lanes)
  std::fill(w.m.begin(), w.m.begin() + rows16, -INFINITY);
  std::fill(w.l.begin(), w.l.begin() + rows16, 0.f);
  std::fill(w.acc.begin(), w.acc.begin() + rows * d, 0.f);
  int64_t lo = INT64_MAX, hi = 0;
  for (int64_t i = 0; i < cnt; ++i) {
    const int64_t st = std::max<int64_t>(in.starts[t0 + i], 0);
    const int64_t en = std::min<int64_t>(in.ends[t0 + i], n.w * s);
    w.st[i] = en > st ? st : 0;
    w.en[i] = en > st ? en : 0;
    if (en > st) {
      lo = std::min(lo, st);
      hi = std::max(hi, en);
    }
  }
  const int64_t sq = in.seq[t0];
  if (sq < 0 || sq >= n.n) hi = 0;  // no such sequence: zeros
  const int32_t* table = in.table + sq * n.w;
  const float* qr[kTile * kMaxGroup];
  for (int64_t r = 0; r < rows; ++r) {
    qr[r] = in.q + ((t0 + r / n.g) * n.hq + h * n.g + r % n.g) * d;
  }
  float* kt = w.kt.data();
  float* sc = w.sc.data();
  const bool decode = cnt == 1 && s == 16 && (d == 64 || d == 128);  // DecodePage's rows
  // A prefill tile of 16 rows or more: LanesPage, groups of 16 rows as a vector's lanes, their
  // queries transposed once here ([D, 16] a group; rows past `rows` zeros with no keys).
  const bool lanes = !decode && s == 16 && (d == 64 || d == 128) && rows >= 16;
  if (lanes) {
    for (int64_t r = 0; r < rows16; ++r) {
      const bool real = r < rows;
      w.rst[r] = real ? static_cast<int32_t>(w.st[r / n.g]) : 0;
      w.ren[r] = real ? static_cast<int32_t>(w.en[r / n.g]) : 0;
      float* qt = w.qt.data() + (r / 16) * 16 * d + r % 16;
      for (int64_t x = 0; x < d; ++x) qt[16 * x] = real ? qr[r][x] : 0.f;
    }
  }
  for (int64_t p0 = hi > 0 ? lo - lo % s : 0; p0 < hi; p0 += s) {
    const int64_t page = table[p0 / s];
    if (page < 0 || page >= n.p) continue;  // never for a valid table: nothing read
    const int64_t jlo = std::max<int64_t>(lo - p0, 0), jhi = std::min<int64_t>(s, hi - p0);
    const int64_t row = (h * n.p + page) * s;  // the page's first slot
    const float *kp, *vp;
    if (in.k != nullptr) {
      kp = in.k + row * d;
      vp = in.v + row * d;
    } else {
      Dequantize(in.kq + row * d, in.ks + row, in.lut, jlo, jhi, d, w.kbuf.data());
      Dequantize(in.vq + row * d, in.vs + row, in.lut, jlo, jhi, d, w.vbuf.data());
      kp = w.kbuf.data();
      vp = w.vbuf.data();
    }
    // The next page: a float32 decode row fetches it into L2 during this page's values
    // (RowValues: K and V rows interleaved with the work, with pages in order or not;
    // the hardware's prefetcher alone left the decode step's K/V reads a third slower).
    // Otherwise its slots are fetched here, at once, where it does not follow this page in
    // memory (along a run of pages the hardware's prefetcher does better alone).
    const float *kn = nullptr, *vn = nullptr;
    if (p0 + s < hi) {
      const int64_t next = table[p0 / s + 1];
      const bool f32 = in.k != nullptr, valid = next >= 0 && next < n.p;
      if (valid && decode && f32) {
        kn = in.k + (h * n.p + next) * s * d;
        vn = in.v + (h * n.p + next) * s * d;
      } else if (valid && next != page + 1) {
        const int64_t at = (h * n.p + next) * s * d, bytes = s * d * (f32 ? 4 : 1);
        const char* kb = f32 ? reinterpret_cast<const char*>(in.k + at)
                             : reinterpret_cast<const char*>(in.kq + at);
        const char* vb = f32 ? reinterpret_cast<const char*>(in.v + at)
                             : reinterpret_cast<const char*>(in.vq + at);
        for (int64_t b = 0; b < bytes; b += 64) {
          __builtin_prefetch(kb + b, 0, 2);
          __builtin_prefetch(vb + b, 0, 2);
        }
      }
    }
    // Scores of every row against the page's keys [jlo, jhi) (slots of the tile's union of
    // ranges: all written); a row reads back only its own keys.
    if (decode) {  // a decode row: DecodePage
      const int64_t a = std::max<int64_t>(w.st[0] - p0, jlo);
      const int64_t b = std::min<int64_t>(w.en[0] - p0, jhi);
      if (a >= b) continue;
      float *m = w.m.data(), *l = w.l.data(), *acc = w.acc.data();
      if (d == 64) {
        DecodePage<4>(qr, rows, kp, vp, a, b, in.scale, in.cap, m, l, acc, sc, kn, vn);
      } else {
        DecodePage<8>(qr, rows, kp, vp, a, b, in.scale, in.cap, m, l, acc, sc, kn, vn);
      }
      continue;
    }
    if (lanes) {
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const float* qt = w.qt.data() + r0 * d;
        const int32_t *rst = w.rst.data() + r0, *ren = w.ren.data() + r0;
        float *m = w.m.data() + r0, *l = w.l.data() + r0, *acc = w.acc.data() + r0 * d;
        const int64_t nr = std::min<int64_t>(16, rows - r0);
        if (d == 64) {
          LanesPage<4>(qt, rst, ren, nr, p0, kp, vp, jlo, jhi, in.scale, in.cap, m, l, acc,
                       w.pb.data());
        } else {
          LanesPage<8>(qt, rst, ren, nr, p0, kp, vp, jlo, jhi, in.scale, in.cap, m, l, acc,
                       w.pb.data());
        }
      }
      continue;
    }
    if (s == 16 && rows >= 8) {  // a tile of several tokens: K transposed once for all
      if (d % 16 == 0) {  // 16 x 16 blocks in registers (unused slots as zeros)
        for (int64_t x0 = 0; x0 < d; x0 += 16) {
          V16 block[16];
          for (int64_t j = 0; j < 16; ++j) {
            block[j] = j >= jlo && j < jhi ? Load16(kp + j * d + x0) : V16{};
          }
          Transpose16(block);
          for (int64_t x = 0; x < 16; ++x) Store16(kt + (x0 + x) * 16, block[x]);
        }
      } else {
        for (int64_t j = 0; j < 16; ++j) {
          const bool used = j >= jlo && j < jhi;
          for (int64_t x = 0; x < d; ++x) kt[x * 16 + j] = used ? kp[j * d + x] : 0.f;
        }
      }
      int64_t r = 0;
      for (; r + 8 <= rows; r += 8) Scores16<8>(kt, qr + r, d, sc + r * 16);
      for (; r + 4 <= rows; r += 4) Scores16<4>(kt, qr + r, d, sc + r * 16);
      for (; r + 2 <= rows; r += 2) Scores16<2>(kt, qr + r, d, sc + r * 16);
      for (; r < rows; ++r) Scores16<1>(kt, qr + r, d, sc + r * 16);
    } else {  // pages of another size, or under 8 rows DecodePage does not serve (other
              // head_dims, a short tile's few tokens): each key's dot products as it lies
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = jlo; j < jhi; ++j) {
          const float* kj = kp + j * d;
          float dot = 0.f;
          for (int64_t x = 0; x < d; ++x) dot += qr[r][x] * kj[x];
          sc[r * s + j] = dot;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r / n.g;
      const int64_t a = std::max<int64_t>(w.st[i] - p0, jlo);
      const int64_t b = std::min<int64_t>(w.en[i] - p0, jhi);
      if (a >= b) continue;
      float* sr = sc + r * s;
      float corr;
      if (s == 16) {
        corr = Softmax16(Load16(sr) * in.scale, a, b, in.cap, sr, w.m[r], w.l[r]);
      } else {
        float mx = w.m[r];
        for (int64_t j = a; j < b; ++j) {
          float x = sr[j] * in.scale;
          if (in.cap > 0.f) x = in.cap * std::tanh(x / in.cap);
          sr[j] = x;
          mx = std::max(mx, x);
        }
        corr = Exp(w.m[r] - mx);
        float sum = 0.f;
        for (int64_t j = a; j < b; ++j) {
          sr[j] = Exp(sr[j] - mx);
          sum += sr[j];
        }
        w.l[r] = w.l[r] * corr + sum;
        w.m[r] = mx;
      }
      float* acc = w.acc.data() + r * d;
      if (d == 64) {
        Values<4>(acc, corr, sr, vp, a, b);
      } else if (d == 128) {
        Values<8>(acc, corr, sr, vp, a, b);
      } else {
        for (int64_t x = 0; x < d; ++x) acc[x] *= corr;
        for (int64_t j = a; j < b; ++j) {
          const float pj = sr[j];
          const float* vj = vp + j * d;
          for (int64_t x = 0; x < d; ++x) acc[x] += pj * vj[x];
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = in.out + ((t0 + r / n.g) * n.hq + h * n.g + r % n.g) * d;
    float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
    if (in.sinks != nullptr) {  // acc e^(m - m') / (l e^(m - m') + e^(sink - m'))
      const float sink = in.sinks[h * n.g + r % n.g], mx = std::max(w.m[r], sink);
      const float scale = Exp(w.m[r] - mx);
      inv = scale / (w.l[r] * scale + Exp(sink - mx));
    }
    const float* acc = w.acc.data() + r * d;
    for (int64_t x = 0; x < d; ++x) o[x] = acc[x] * inv;
  }
}

// The shapes of a call (pool dims kd, vd: [Hkv, P, S, D]), or an error.
ffi::Error Check(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
                 ffi::Span<const int64_t> vd, ffi::Span<const int64_t> td,
                 const ffi::Buffer<ffi::S32>& seq, const ffi::Buffer<ffi::S32>& starts,
                 const ffi::Buffer<ffi::S32>& ends, const ffi::Buffer<ffi::F32>& sinks,
                 bool has_sinks, Shapes& n) {
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || vd.size() != 4 ||
      seq.dimensions().size() != 1 || starts.dimensions().size() != 1 ||
      ends.dimensions().size() != 1 || !std::equal(kd.begin(), kd.end(), vd.begin())) {
    return ffi::Error::InvalidArgument("paged attention: unexpected ranks or shapes");
  }
  n = Shapes{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[0], td[1], 0};
  if (n.hkv == 0 || n.hq % n.hkv || kd[3] != n.d || seq.dimensions()[0] != n.t ||
      starts.dimensions()[0] != n.t || ends.dimensions()[0] != n.t ||
      (has_sinks && (sinks.dimensions().size() != 1 || sinks.dimensions()[0] != n.hq))) {
    return ffi::Error::InvalidArgument("paged attention: shapes do not agree");
  }
  n.g = n.hq / n.hkv;
  if (n.g > kMaxGroup || n.d > kMaxDim || n.s > kMaxPage) {
    return ffi::Error::InvalidArgument("paged attention: group, head_dim or page too large");
  }
  return ffi::Error::Success();
}

// Tiles of the call's tokens, then items (tile, KV head) over this thread and XLA's pool
// (cpu_pool.h).
void Run(const Shapes& n, const Inputs& in, ffi::ThreadPool& pool, int64_t threads) {
  std::vector<int64_t> tiles;  // first token of each tile, then T
  for (int64_t t = 0; t < n.t; ++t) {
    if (tiles.empty() || in.seq[t] != in.seq[tiles.back()] || t - tiles.back() == kTile) {
      tiles.push_back(t);
    }
  }
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  tiles.push_back(n.t);
  jpaged::ParallelFor(pool, threads, num_tiles * n.hkv, [n, in, tiles] {
    return [n, in, &tiles, scratch = std::make_shared<Scratch>(n)](int64_t i) {
      const int64_t tile = i / n.hkv;
      AttendTile(n, in, tiles[tile], tiles[tile + 1] - tiles[tile], i % n.hkv, *scratch);
    };
  });
}

ffi::Error Impl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> seq,
                ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> ends,
                ffi::Buffer<ffi::F32> sinks, float sm_scale, float soft_cap, bool has_sinks,
                int64_t threads, ffi::ThreadPool pool, ffi::ResultBuffer<ffi::F32> out) {
  Shapes n;
  ffi::Error error = Check(q.dimensions(), k.dimensions(), v.dimensions(), table.dimensions(),
                           seq, starts, ends, sinks, has_sinks, n);
  if (error.failure()) return error;
  const Inputs in{q.typed_data(),     k.typed_data(),   v.typed_data(),
                  table.typed_data(), seq.typed_data(), starts.typed_data(),
                  ends.typed_data(),  has_sinks ? sinks.typed_data() : nullptr,
                  sm_scale,           soft_cap,         out->typed_data()};
  Run(n, in, pool, threads);
  return ffi::Error::Success();
}

// A quantized pool (kv_quant.PoolBits' bits): K and V bytes with their rows' bfloat16 scale
// bits, and lut [256] the value of each byte in the pool's dtype (int8, fp8 e4m3 or e5m2).
ffi::Error ImplQuantized(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> kq,
                         ffi::Buffer<ffi::U16> ks, ffi::Buffer<ffi::U8> vq,
                         ffi::Buffer<ffi::U16> vs, ffi::Buffer<ffi::F32> lut,
                         ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> seq,
                         ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> ends,
                         ffi::Buffer<ffi::F32> sinks, float sm_scale, float soft_cap,
                         bool has_sinks, int64_t threads, ffi::ThreadPool pool,
                         ffi::ResultBuffer<ffi::F32> out) {
  Shapes n;
  ffi::Error error = Check(q.dimensions(), kq.dimensions(), vq.dimensions(),
                           table.dimensions(), seq, starts, ends, sinks, has_sinks, n);
  if (error.failure()) return error;
  const auto sd = ks.dimensions();
  if (lut.element_count() != 256 || sd.size() != 3 || sd[0] != n.hkv || sd[1] != n.p ||
      sd[2] != n.s || !std::equal(sd.begin(), sd.end(), vs.dimensions().begin())) {
    return ffi::Error::InvalidArgument("paged attention: scales [Hkv, P, S], lut [256]");
  }
  Inputs in{q.typed_data(),     nullptr,          nullptr,
            table.typed_data(), seq.typed_data(), starts.typed_data(),
            ends.typed_data(),  has_sinks ? sinks.typed_data() : nullptr,
            sm_scale,           soft_cap,         out->typed_data()};
  in.kq = kq.typed_data();
  in.vq = vq.typed_data();
  in.ks = ks.typed_data();
  in.vs = vs.typed_data();
  in.lut = lut.typed_data();
  Run(n, in, pool, threads);
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
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<bool>("has_sinks")
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedCpuPagedAttentionQuantized, ImplQuantized,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<bool>("has_sinks")
                                  .Attr<int64_t>("threads")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
