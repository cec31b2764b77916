// Binds torch's OpenMP threads one to a CPU, and the process's memory to the NUMA nodes of
// those CPUs, as vLLM's CPU worker does. Only code running on each pool thread can pin that
// thread, hence C++: a parallel loop of exactly one index per thread.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#ifdef __linux__
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#endif

namespace {

#ifdef __linux__

constexpr int kMpolBind = 2;  // MPOL_BIND from <linux/mempolicy.h>
constexpr int kMaxNodes = 1024;

void bind_memory(const std::vector<int64_t>& nodes) {
  std::vector<unsigned long> mask(kMaxNodes / (8 * sizeof(unsigned long)), 0);
  const int64_t bits = 8 * sizeof(unsigned long);
  for (int64_t node : nodes) {
    TORCH_CHECK(node >= 0 && node < kMaxNodes, "NUMA node ", node, " out of range");
    mask[node / bits] |= 1UL << (node % bits);
  }
  long failed = syscall(SYS_set_mempolicy, kMpolBind, mask.data(), kMaxNodes + 1);
  TORCH_CHECK(failed == 0, "set_mempolicy(MPOL_BIND) failed: ", std::strerror(errno));
}

// Returns each pool thread's Linux thread id, in thread order (so the caller can check that
// every index ran on a thread of its own).
std::vector<int64_t> bind_threads(std::vector<int64_t> cpus, std::vector<int64_t> nodes) {
  TORCH_CHECK(!cpus.empty(), "bind_threads needs at least one CPU");
  if (!nodes.empty()) bind_memory(nodes);
  const int64_t count = static_cast<int64_t>(cpus.size());
  at::set_num_threads(static_cast<int>(count));
  std::vector<int64_t> tids(count, -1);
  std::vector<int> errors(count, 0);
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[i]), &set);
      errors[i] = sched_setaffinity(0, sizeof(set), &set) == 0 ? 0 : errno;
      tids[i] = static_cast<int64_t>(syscall(SYS_gettid));
    }
  });
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(errors[i] == 0, "sched_setaffinity to CPU ", cpus[i], " failed: ",
                std::strerror(errors[i]));
  }
  return tids;
}

// Runs `count` pool threads, each free to move among all of `cpus` (undoing bind_threads' one
// CPU per thread); returns their Linux thread ids in thread order.
std::vector<int64_t> release_threads(std::vector<int64_t> cpus, int64_t count) {
  TORCH_CHECK(!cpus.empty() && count >= 1, "release_threads needs CPUs and a thread count");
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int64_t cpu : cpus) CPU_SET(static_cast<int>(cpu), &set);
  at::set_num_threads(static_cast<int>(count));
  std::vector<int64_t> tids(count, -1);
  std::vector<int> errors(count, 0);
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      errors[i] = sched_setaffinity(0, sizeof(set), &set) == 0 ? 0 : errno;
      tids[i] = static_cast<int64_t>(syscall(SYS_gettid));
    }
  });
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(errors[i] == 0, "sched_setaffinity failed: ", std::strerror(errors[i]));
  }
  return tids;
}
#else
std::vector<int64_t> bind_threads(std::vector<int64_t>, std::vector<int64_t>) {
  TORCH_CHECK(false, "binding threads to CPUs needs Linux");
}

std::vector<int64_t> release_threads(std::vector<int64_t>, int64_t) {
  TORCH_CHECK(false, "binding threads to CPUs needs Linux");
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(runtime_cpu, m) {
  m.def("bind_threads(int[] cpus, int[] nodes) -> int[]", &bind_threads);
  m.def("release_threads(int[] cpus, int count) -> int[]", &release_threads);
}
