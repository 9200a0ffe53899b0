// Internal declarations of the I/O engine, shared by io_engine.cpp (the C ABI and the choice of
// backend) and the two backends, threads_engine.cpp and uring_engine.cpp: UniqueFd,
// Request/Chunk, the abstract Engine (request bookkeeping common to both backends) and each
// backend's entry points. Not part of the C ABI (the library is built with
// -fvisibility=hidden, so nothing here is exported).
//
// [Note: short transfers] A partial pread/pwrite/CQE is resumed from where it stopped, with
// EINTR/EAGAIN retried. A read that returns 0 is EOF. With O_DIRECT a read can only stop at
// an unaligned position at EOF (and resuming there would fail with EINVAL), so a partial
// O_DIRECT read ending off a 512-byte boundary is treated as EOF. A request's result is the
// number of bytes valid from its start (the prefix before the first short chunk) or -errno
// of the first failing chunk.
#pragma once
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace zt {
namespace io {

enum Op { kRead = 0, kWrite = 1 };

constexpr int kMaxRetries = 1000;           // EINTR/EAGAIN resubmissions per chunk

// Owns a file descriptor: closed on destruction or reset().
class UniqueFd {
  public:
    UniqueFd() = default;
    explicit UniqueFd(int fd) : fd_(fd) {}
    UniqueFd(const UniqueFd&) = delete;
    UniqueFd& operator=(const UniqueFd&) = delete;
    ~UniqueFd() { reset(); }
    int get() const { return fd_; }
    void reset(int fd = -1) {
        if (fd_ >= 0) close(fd_);
        fd_ = fd;
    }

  private:
    int fd_ = -1;
};

// ---------------------------------------------------------------------------------------
// Requests and chunks. All fields except Chunk::done/retries are guarded by Engine::mu;
// Chunk::done/retries belong to whichever thread currently issues the chunk.

struct Request;

struct Chunk {
    Request* req;
    uint64_t rel;        // offset of this chunk inside the request
    uint32_t len;        // bytes this chunk must transfer
    uint32_t done = 0;   // bytes transferred so far (partial transfers resume here)
    int retries = 0;
};

struct Request {
    int op, fd;
    char* buf;
    uint64_t nbytes, offset;
    std::vector<Chunk> chunks;  // never resized after submit: Chunk* stay valid
    size_t remaining = 0;       // chunks not yet finished
    int err = 0;                // first errno seen (positive), 0 if none
    uint64_t valid = 0;         // bytes valid from the start (shrinks on a short chunk)
    bool complete = false;

    int64_t result() const { return err ? -(int64_t)err : (int64_t)valid; }
};

// After a partial transfer of `c`, may we resume at c->done? (see [Note: short transfers])
inline bool may_resume_read(const Chunk* c) {
    if (c->done % 512 == 0) return true;
    int fl = fcntl(c->req->fd, F_GETFL);
    return fl < 0 || !(fl & O_DIRECT);
}

// ---------------------------------------------------------------------------------------
// The engine: request bookkeeping shared by both backends.

class Engine {
  public:
    Engine(unsigned qd, unsigned block) : qd_(qd), block_(block) {}
    virtual ~Engine() = default;
    virtual const char* name() const = 0;
    virtual std::string info() const { return name(); }

    // The pid that created the engine; see [Note: engines after fork].
    pid_t owner() const { return owner_; }

    int64_t submit(int op, int fd, void* buf, uint64_t nbytes, uint64_t offset) {
        if (op != kRead && op != kWrite) return -EINVAL;
        if (nbytes && !buf) return -EFAULT;
        // Everything that allocates happens before the request is visible to the backend;
        // a bad_alloc leaves nothing behind (the caller maps it to -ENOMEM).
        auto owned = std::make_unique<Request>();
        Request* r = owned.get();
        r->op = op;
        r->fd = fd;
        r->buf = static_cast<char*>(buf);
        r->nbytes = nbytes;
        r->offset = offset;
        r->valid = nbytes;
        size_t n = (size_t)((nbytes + block_ - 1) / block_);
        r->chunks.reserve(n);
        for (uint64_t rel = 0; rel < nbytes; rel += block_)
            r->chunks.push_back(Chunk{r, rel, (uint32_t)std::min<uint64_t>(block_, nbytes - rel)});
        r->remaining = n;

        std::unique_lock<std::mutex> lk(mu_);
        if (stopping_) return -ESHUTDOWN;
        int64_t id = next_id_++;
        requests_.emplace(id, std::move(owned));  // on throw the Request is freed
        if (n == 0) {
            r->complete = true;
            lk.unlock();
            signal_completions();
            return id;
        }
        size_t queued = 0;
        try {
            for (auto& c : r->chunks) {
                pending_.push_back(&c);
                ++queued;
            }
        } catch (...) {  // the deque could not grow: unpublish the request before anyone saw it
            pending_.erase(pending_.end() - (std::ptrdiff_t)queued, pending_.end());
            requests_.erase(id);
            throw;
        }
        kick_locked();
        return id;
    }

    // 0: done (result stored, request forgotten); 1: timed out; -ENOENT: unknown id.
    int wait(int64_t id, int64_t timeout_ms, int64_t* result) {
        std::unique_lock<std::mutex> lk(mu_);
        // Look the id up on every wakeup: another thread may have consumed it meanwhile.
        auto ready = [&] {
            auto it = requests_.find(id);
            return it == requests_.end() || it->second->complete;
        };
        if (timeout_ms < 0) {
            cv_done_.wait(lk, ready);
        } else if (!cv_done_.wait_for(lk, std::chrono::milliseconds(timeout_ms), ready)) {
            return 1;
        }
        return take_locked(id, result);
    }

    // 1: done (result stored, request forgotten); 0: still running; -ENOENT: unknown id.
    int poll(int64_t id, int64_t* result) {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = requests_.find(id);
        if (it == requests_.end()) return -ENOENT;
        if (!it->second->complete) return 0;
        return take_locked(id, result) == 0 ? 1 : -ENOENT;
    }

    // Fail every chunk not yet issued with ECANCELED; issued chunks run to completion.
    int cancel_pending() {
        std::unique_lock<std::mutex> lk(mu_);
        int n = (int)pending_.size();
        bool any = false;
        while (!pending_.empty()) {
            Chunk* c = pending_.front();
            pending_.pop_front();
            any |= finish_chunk_locked(c, ECANCELED);
        }
        lk.unlock();
        if (any) signal_completions();
        return n;
    }

    int64_t inflight_requests() {
        std::lock_guard<std::mutex> lk(mu_);
        int64_t n = 0;
        for (auto& kv : requests_) n += !kv.second->complete;
        return n;
    }

    // Stop accepting work, let queued and issued chunks finish, then stop the backend.
    void shutdown() {
        std::unique_lock<std::mutex> lk(mu_);
        stopping_ = true;
        cv_done_.wait(lk, [&] { return pending_.empty() && issued_ == 0; });
        lk.unlock();
        stop_backend();
    }

  protected:
    // Backend hooks (called with mu_ held): new chunks were appended to pending_.
    virtual void kick_locked() = 0;
    virtual void stop_backend() = 0;

    // Record the end of a chunk (err = positive errno or 0). Returns true when this
    // completed its request. Caller holds mu_ and calls signal_completions() after unlock.
    bool finish_chunk_locked(Chunk* c, int err) {
        Request* r = c->req;
        if (err && !r->err) r->err = err;
        if (!err && c->done < c->len) r->valid = std::min<uint64_t>(r->valid, c->rel + c->done);
        if (--r->remaining == 0) {
            r->complete = true;
            return true;
        }
        return false;
    }

    void signal_completions() { cv_done_.notify_all(); }

    int take_locked(int64_t id, int64_t* result) {
        auto it = requests_.find(id);
        if (it == requests_.end()) return -ENOENT;
        if (result) *result = it->second->result();
        requests_.erase(it);
        return 0;
    }

    const unsigned qd_, block_;
    std::mutex mu_;
    std::condition_variable cv_done_;  // a request completed, or issued_ dropped to 0
    std::unordered_map<int64_t, std::unique_ptr<Request>> requests_;
    std::deque<Chunk*> pending_;       // chunks not yet handed to the kernel / a worker
    unsigned issued_ = 0;              // chunks handed to the kernel / a worker
    int64_t next_id_ = 1;
    bool stopping_ = false;
    const pid_t owner_ = getpid();
};

// ---------------------------------------------------------------------------------------
// The backends. io_engine.cpp picks one in zt_io_create; these may throw (bad_alloc,
// std::system_error from thread creation), which its zt::guard turns into a failure.

// threads_engine.cpp: a pool of `threads` workers, at most `qd` chunks in flight.
std::unique_ptr<Engine> make_threads_engine(unsigned qd, unsigned block, unsigned threads);

// uring_engine.cpp: an io_uring engine whose ring thread has set the ring up, or nullptr
// with the reason in *why when that failed (no io_uring here, setup refused, ...).
std::unique_ptr<Engine> make_uring_engine(unsigned qd, unsigned block, unsigned threads,
                                          std::string* why);

// uring_engine.cpp: does io_uring work here? true with *why = "ok", or false and the reason.
bool uring_probe(std::string* why);

}  // namespace io
}  // namespace zt
