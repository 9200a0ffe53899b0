// The I/O engine's thread-pool backend ("threads"): a pthread pool; each worker pops a chunk
// and loops pread/pwrite until done (see [Note: short transfers] in io/engine.h). Request
// bookkeeping is the shared Engine (io/engine.h); the one entry point is make_threads_engine,
// called by zt_io_create in io_engine.cpp.

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/types.h>
#include <unistd.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "io/engine.h"

namespace zt {
namespace io {
namespace {

// ---------------------------------------------------------------------------------------
// Synchronous transfer of one chunk with retries (threads backend). Returns 0 or errno.

int transfer_sync(Chunk* c) {
    Request* r = c->req;
    while (c->done < c->len) {
        char* p = r->buf + c->rel + c->done;
        size_t n = c->len - c->done;
        off_t off = (off_t)(r->offset + c->rel + c->done);
        ssize_t got = r->op == kRead ? pread(r->fd, p, n, off) : pwrite(r->fd, p, n, off);
        if (got < 0) {
            if (errno == EINTR && ++c->retries < kMaxRetries) continue;
            return errno;
        }
        if (got == 0) return r->op == kRead ? 0 : EIO;  // read: EOF; write: no progress
        c->done += (uint32_t)got;
        if (r->op == kRead && c->done < c->len && !may_resume_read(c)) return 0;  // EOF
    }
    return 0;
}

class ThreadsEngine final : public Engine {
  public:
    ThreadsEngine(unsigned qd, unsigned block, unsigned threads) : Engine(qd, block) {
        try {
            for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this, i] { run(i); });
        } catch (...) {  // joinable std::threads must not be destroyed: join those started
            stop_backend();
            throw;
        }
    }
    ~ThreadsEngine() override { shutdown(); }
    const char* name() const override { return "threads"; }
    std::string info() const override {
        return "threads workers=" + std::to_string(workers_.size()) + " qd=" + std::to_string(qd_);
    }

  protected:
    void kick_locked() override { cv_work_.notify_all(); }
    void stop_backend() override {
        {
            std::lock_guard<std::mutex> lk(mu_);
            quit_ = true;
        }
        cv_work_.notify_all();
        for (auto& t : workers_) t.join();
        workers_.clear();
    }

  private:
    // Allocates nothing and calls nothing that throws: see [Note: native error contract].
    void run(unsigned i) noexcept {
        char nm[16];
        snprintf(nm, sizeof nm, "zt-io-%u", i);
        pthread_setname_np(pthread_self(), nm);
        std::unique_lock<std::mutex> lk(mu_);
        for (;;) {
            // queue_depth bounds concurrency even when there are more workers than slots.
            cv_work_.wait(lk, [&] { return quit_ || (!pending_.empty() && issued_ < qd_); });
            if (quit_) return;
            Chunk* c = pending_.front();
            pending_.pop_front();
            ++issued_;
            lk.unlock();
            int err = transfer_sync(c);
            lk.lock();
            --issued_;
            bool completed = finish_chunk_locked(c, err);
            if (!pending_.empty()) cv_work_.notify_one();  // a slot freed up
            if (completed || (stopping_ && issued_ == 0)) {
                lk.unlock();
                signal_completions();
                lk.lock();
            }
        }
    }

    std::vector<std::thread> workers_;
    std::condition_variable cv_work_;
    bool quit_ = false;
};

}  // namespace

std::unique_ptr<Engine> make_threads_engine(unsigned qd, unsigned block, unsigned threads) {
    return std::make_unique<ThreadsEngine>(qd, block, threads);
}

}  // namespace io
}  // namespace zt
