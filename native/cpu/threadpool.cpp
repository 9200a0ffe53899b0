#include "cpu/threadpool.h"

#include <pthread.h>
#include <unistd.h>

#include <stdexcept>
#include <string>
#include <system_error>

namespace zt {

namespace {

ThreadPool* g_pool = nullptr;  // guarded by g_pool_mu; see [Note: pool after fork]
std::mutex g_pool_mu;

// fork() waits until no thread is creating the pool; the child, alone, unlocks the mutex
// its forking thread locked and forgets the inherited pool (leaked on purpose).
void before_fork() { g_pool_mu.lock(); }
void after_fork_in_parent() { g_pool_mu.unlock(); }
void after_fork_in_child() {
  g_pool = nullptr;
  g_pool_mu.unlock();
}

[[maybe_unused]] const int g_atfork_registered =
    pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);

}  // namespace

ThreadPool& ThreadPool::instance() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (!g_pool) g_pool = new ThreadPool();
  return *g_pool;
}

void ThreadPool::grow(int nworkers) {
  while ((int)workers_.size() < nworkers) {
    int tid = (int)workers_.size() + 1;
    try {
      workers_.emplace_back([this, tid] { worker_loop(tid); });
    } catch (const std::system_error& ex) {
      throw std::runtime_error("cannot start CPU worker thread " + std::to_string(tid) + " of " +
                               std::to_string(nworkers) + " (" + ex.what() +
                               "): use fewer threads (optimizer.threads, CPUAdamW(threads=...)) or raise "
                               "the process's thread or memory limits (ulimit -u, ulimit -v)");
    }
  }
}

void ThreadPool::worker_loop(int tid) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int, int)>* fn;
    int nthreads;
    {
      std::unique_lock<std::mutex> lk(mu_);
      wake_cv_.wait(lk, [&] { return generation_ != seen && tid < active_; });
      seen = generation_;
      fn = fn_;
      nthreads = active_;
    }
    std::exception_ptr err;
    try {
      (*fn)(tid, nthreads);
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (err && !error_) error_ = err;
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::run(int nthreads, const std::function<void(int, int)>& fn) {
  if (nthreads <= 1) {
    fn(0, 1);
    return;
  }
  std::lock_guard<std::mutex> call_lk(call_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    grow(nthreads - 1);
    fn_ = &fn;
    error_ = nullptr;
    active_ = nthreads;
    pending_ = nthreads - 1;
    ++generation_;
  }
  wake_cv_.notify_all();
  std::exception_ptr err;
  try {
    fn(0, nthreads);
  } catch (...) {
    err = std::current_exception();
  }
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return pending_ == 0; });  // workers still use fn until here
  fn_ = nullptr;
  if (!err) err = error_;
  error_ = nullptr;
  if (err) std::rethrow_exception(err);
}

int hardware_threads() {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

}  // namespace zt
