// A persistent worker pool for the CPU kernels.
//
// Workers sleep on a condition variable between calls (no spinning, so they do
// not steal cycles from torch's own threads or the I/O engine). run() executes
// fn(tid, nthreads) on nthreads threads, the caller being tid 0, and returns
// when all are done. Calls from several Python threads are serialized.
//
// An exception thrown by fn on any thread is caught there; run() rethrows the first one
// in the caller once every thread has finished (fn and what it captures live on the
// caller's stack). Failing to start a worker thread throws std::runtime_error from run(),
// saying what to do.
//
// [Note: pool after fork] fork() copies the pool but not its threads, so a run() in the
// child would wait forever for workers that do not exist. A pthread_atfork child handler
// forgets the inherited pool without touching it (parent threads may have held its
// mutexes, and its std::threads must be neither joined nor destroyed); the child's first
// instance() builds a fresh pool. The pool is never destroyed: exit() ends its sleeping
// workers, and no static destructor joins threads during shutdown.
#pragma once
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace zt {

class ThreadPool {
 public:
  static ThreadPool& instance();
  void run(int nthreads, const std::function<void(int, int)>& fn);

 private:
  void grow(int nworkers);
  void worker_loop(int tid);

  std::mutex call_mu_;  // one run() at a time
  std::mutex mu_;
  std::condition_variable wake_cv_, done_cv_;
  std::vector<std::thread> workers_;  // workers_[i] has tid i+1
  const std::function<void(int, int)>* fn_ = nullptr;
  std::exception_ptr error_;  // first exception of the current generation's workers
  int active_ = 0;        // threads taking part in the current generation
  int pending_ = 0;       // workers that have not finished the current generation
  uint64_t generation_ = 0;
};

int hardware_threads();

}  // namespace zt
