#include "cpu/threadpool.h"

#include <unistd.h>

namespace zt {

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool;
  return pool;
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::grow(int nworkers) {
  while ((int)workers_.size() < nworkers) {
    int tid = (int)workers_.size() + 1;
    workers_.emplace_back([this, tid] { worker_loop(tid); });
  }
}

void ThreadPool::worker_loop(int tid) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int, int)>* fn;
    int nthreads;
    {
      std::unique_lock<std::mutex> lk(mu_);
      wake_cv_.wait(lk, [&] { return stop_ || (generation_ != seen && tid < active_); });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      nthreads = active_;
    }
    (*fn)(tid, nthreads);
    {
      std::lock_guard<std::mutex> lk(mu_);
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
    active_ = nthreads;
    pending_ = nthreads - 1;
    ++generation_;
  }
  wake_cv_.notify_all();
  fn(0, nthreads);
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return pending_ == 0; });
  fn_ = nullptr;
}

int hardware_threads() {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

}  // namespace zt
