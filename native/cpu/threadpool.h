// A persistent worker pool for the CPU kernels.
//
// Workers sleep on a condition variable between calls (no spinning, so they do
// not steal cycles from torch's own threads or the I/O engine). run() executes
// fn(tid, nthreads) on nthreads threads, the caller being tid 0, and returns
// when all are done. Calls from several Python threads are serialized.
#pragma once
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace zt {

class ThreadPool {
 public:
  static ThreadPool& instance();
  void run(int nthreads, const std::function<void(int, int)>& fn);
  ~ThreadPool();

 private:
  void grow(int nworkers);
  void worker_loop(int tid);

  std::mutex call_mu_;  // one run() at a time
  std::mutex mu_;
  std::condition_variable wake_cv_, done_cv_;
  std::vector<std::thread> workers_;  // workers_[i] has tid i+1
  const std::function<void(int, int)>* fn_ = nullptr;
  int active_ = 0;        // threads taking part in the current generation
  int pending_ = 0;       // workers that have not finished the current generation
  uint64_t generation_ = 0;
  bool stop_ = false;
};

int hardware_threads();

}  // namespace zt
