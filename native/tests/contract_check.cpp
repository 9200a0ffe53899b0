// Checks of [Note: native error contract] that Python cannot reach: zt::guard turns every
// kind of exception into the failure value plus a message, and an exception thrown by a
// ThreadPool job on any thread reaches run()'s caller only after every thread has finished
// (the job lives on the caller's stack), leaving the pool usable. Built and run by
// tests/test_native_hardening.py (and under sanitizers by benchmarks/sanitize.sh).
// Prints "ok" and exits 0, or names the failed check and exits 1.
#include <stdio.h>
#include <string.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "cpu/threadpool.h"
#include "zt_api.h"

namespace {

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "FAILED: %s (last error: '%s')\n", what, zt::g_last_error);
    ++failures;
  }
}

void check_guard() {
  int rc = zt::guard<int>("f_ok", -7, [] { return 3; });
  check(rc == 3 && zt::g_last_error[0] == '\0', "guard passes a result through and clears the error");

  rc = zt::guard<int>("f_bad_alloc", -7, []() -> int { throw std::bad_alloc(); });
  check(rc == -7 && strcmp(zt::g_last_error, "f_bad_alloc: out of memory (std::bad_alloc)") == 0,
        "guard: bad_alloc");

  rc = zt::guard<int>("f_runtime", -7, []() -> int { throw std::runtime_error("disk on fire"); });
  check(rc == -7 && strcmp(zt::g_last_error, "f_runtime: disk on fire") == 0, "guard: std::exception");

  rc = zt::guard<int>("f_int", -7, []() -> int { throw 42; });
  check(rc == -7 && strcmp(zt::g_last_error, "f_int: unknown C++ exception") == 0, "guard: non-std exception");

  std::string long_reason(2000, 'x');
  zt::guard<int>("f_long", -7, [&]() -> int { throw std::runtime_error(long_reason); });
  check(strlen(zt::g_last_error) == sizeof zt::g_last_error - 1, "guard: a long message is truncated, not overrun");
}

void check_pool_job_throws_on(int thrower) {
  const int n = 4;
  auto& pool = zt::ThreadPool::instance();
  std::atomic<int> finished{0};
  bool caught = false;
  try {
    pool.run(n, [&](int tid, int) {
      if (tid == thrower) throw std::runtime_error("job failed");
      for (volatile int spin = 0; spin < 2000000; ++spin) {}  // the others outlast the thrower
      ++finished;
    });
  } catch (const std::runtime_error& ex) {
    caught = strcmp(ex.what(), "job failed") == 0;
  }
  check(caught, "run() rethrows the job's exception in the caller");
  check(finished.load() == n - 1, "run() returns only after every other thread finished its share");

  std::atomic<int> sum{0};
  pool.run(n, [&](int tid, int) { sum += tid + 1; });
  check(sum.load() == n * (n + 1) / 2, "the pool still works after a job threw");
}

}  // namespace

int main() {
  check_guard();
  check_pool_job_throws_on(2);  // a worker thread
  check_pool_job_throws_on(0);  // the calling thread
  if (failures) return 1;
  printf("ok\n");
  return 0;
}
