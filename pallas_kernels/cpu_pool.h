// Work shared between the calling thread and XLA's intra-op pool, for the CPU kernels
// (cpu_paged_attention.cc, cpu_sampling.cc, cpu_matmul.cc).
//
// ParallelFor(pool, threads, items, make): items 0 .. items - 1 are handed out one at a time
// from a shared counter to this thread and to threads - 1 tasks scheduled on the pool (no
// threads started per call); each taking thread calls make() once for its worker and the
// worker on each item it takes. A task that starts after every item is taken returns at
// once; ParallelFor returns once every item is done, so a late task never runs one. make must
// capture by value (a late task may still call it).
#ifndef JPAGED_CPU_POOL_H_
#define JPAGED_CPU_POOL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jpaged {

template <typename Make>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t threads, int64_t items, Make make) {
  struct State {
    Make make;
    int64_t items;
    std::atomic<int64_t> next{0}, active{0};
    State(Make m, int64_t n) : make(std::move(m)), items(n) {}
  };
  auto state = std::make_shared<State>(std::move(make), items);
  auto work = [state] {
    State& st = *state;
    st.active.fetch_add(1);
    if (st.next.load() < st.items) {
      auto worker = st.make();
      for (int64_t i = st.next.fetch_add(1); i < st.items; i = st.next.fetch_add(1)) worker(i);
    }
    st.active.fetch_sub(1);
  };
  const int64_t tasks = std::min<int64_t>(threads, items) - 1;
  for (int64_t i = 0; i < tasks; ++i) pool.Schedule([work] { work(); });
  work();
  while (state->active.load() != 0) std::this_thread::yield();
}

}  // namespace jpaged

#endif  // JPAGED_CPU_POOL_H_
