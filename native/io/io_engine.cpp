// zerotier async file I/O engine: a plain C ABI loaded by zerotier/io/native.py (ctypes).
//
// One engine object serves positioned reads/writes of caller-owned memory. Each request is
// split into `block` sized chunks; at most `queue_depth` chunks are in flight at once. Two
// backends, chosen at create time:
//
//   io_uring  raw io_uring_setup/io_uring_enter syscalls (no liburing). One "ring thread"
//             owns the ring: it is the only thread that touches the SQ/CQ rings and the only
//             one that calls io_uring_enter. Callers push chunks on a mutex-protected queue
//             and, if the ring thread sleeps, wake it through an eventfd that the ring keeps
//             a READ armed on. See [Note: why one ring thread].
//   threads   a pthread pool; each worker pops a chunk and loops pread/pwrite until done.
//
// Completion: waiters sleep on a condition variable (never spin).
//
// [Note: buffer lifetime] The engine never copies: the caller's buffer must stay alive and
// unmoved from zt_io_submit until the request is observed complete (zt_io_wait/zt_io_poll
// returned it). The Python layer keeps a reference to the tensor in its in-flight table for
// exactly that span. zt_io_destroy waits for every issued chunk before freeing anything.
//
// [Note: why one ring thread] io_uring posts completions through task_work queued on the
// task that *submitted* the request. If Python threads submitted directly, completions would
// interrupt them, and a submitting thread that exits could get its requests cancelled. With
// a single owner thread, all task_work runs inside that thread's io_uring_enter(GETEVENTS),
// which also lets us ask for IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN.
//
// [Note: engines after fork] fork() copies an engine but not its threads, and the child
// shares the parent's io_uring rings (MAP_SHARED). Each engine remembers the pid that
// created it; in any other process every call on its handle fails with ZT_ERR_FORKED
// without touching it (zt_io_destroy included: the child's copy is leaked on purpose), so a
// forked child can neither hang on requests nobody will complete nor corrupt the parent's
// ring. A child that needs I/O creates its own engine.
//
// [Note: short transfers] A partial pread/pwrite/CQE is resumed from where it stopped, with
// EINTR/EAGAIN retried. A read that returns 0 is EOF. With O_DIRECT a read can only stop at
// an unaligned position at EOF (and resuming there would fail with EINVAL), so a partial
// O_DIRECT read ending off a 512-byte boundary is treated as EOF. A request's result is the
// number of bytes valid from its start (the prefix before the first short chunk) or -errno
// of the first failing chunk.

#include <linux/io_uring.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "zt_api.h"

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif
#ifndef IORING_SETUP_SINGLE_ISSUER
#define IORING_SETUP_SINGLE_ISSUER (1U << 12)
#endif
#ifndef IORING_SETUP_DEFER_TASKRUN
#define IORING_SETUP_DEFER_TASKRUN (1U << 13)
#endif
#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#endif

namespace {

enum Op { kRead = 0, kWrite = 1 };
enum BackendKind { kIoUring = 0, kThreads = 1 };

constexpr int kMaxRetries = 1000;           // EINTR/EAGAIN resubmissions per chunk
constexpr uint64_t kWakeTag = ~0ULL;        // user_data of the ring's wake-eventfd READ
// Where the wake READ lands. The value is never used; a static avoids any question of the
// kernel writing into a freed engine if a READ is still armed when the ring is torn down.
uint64_t g_wake_sink;

void copy_out(char* out, int len, const std::string& msg) {
    if (out && len > 0) snprintf(out, (size_t)len, "%s", msg.c_str());
}

std::string errno_str(const char* what, int err) {
    return std::string(what) + ": " + strerror(err);
}

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
bool may_resume_read(const Chunk* c) {
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

// ---------------------------------------------------------------------------------------
// A raw io_uring: setup, mmap of the rings, SQE production, CQE consumption.
// Memory ordering: the kernel reads sq.tail and writes sq.head/cq.tail concurrently, so
// we load kernel-written indices with acquire (to see the entries they publish) and store
// our indices with release (to publish the SQEs we wrote / free the CQEs we read).

struct Ring {
    Ring() = default;
    Ring(const Ring&) = delete;
    Ring& operator=(const Ring&) = delete;
    ~Ring() { destroy(); }

    int fd = -1;
    unsigned flags = 0, features = 0, sq_entries = 0, cq_entries = 0;
    unsigned *sq_head = nullptr, *sq_tail = nullptr, *sq_mask = nullptr, *sq_array = nullptr;
    unsigned *cq_head = nullptr, *cq_tail = nullptr, *cq_mask = nullptr;
    io_uring_sqe* sqes = nullptr;
    io_uring_cqe* cqes = nullptr;
    void *sq_map = MAP_FAILED, *cq_map = MAP_FAILED;
    size_t sq_map_len = 0, cq_map_len = 0, sqes_len = 0;
    unsigned sq_tail_local = 0;  // our private copy of *sq_tail (only we write it)

    // Returns 0 or -errno; `why` gets a reason on failure.
    int init(unsigned entries, unsigned setup_flags, std::string* why) {
        io_uring_params p;
        memset(&p, 0, sizeof p);
        p.flags = setup_flags;
        int rfd = (int)syscall(__NR_io_uring_setup, entries, &p);
        if (rfd < 0) {
            int e = errno;
            *why = errno_str("io_uring_setup", e);
            return -e;
        }
        fd = rfd;
        flags = setup_flags;
        features = p.features;
        sq_entries = p.sq_entries;
        cq_entries = p.cq_entries;
        sq_map_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
        cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
        bool single = p.features & IORING_FEAT_SINGLE_MMAP;
        if (single) sq_map_len = cq_map_len = std::max(sq_map_len, cq_map_len);
        sq_map = mmap(nullptr, sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                      IORING_OFF_SQ_RING);
        if (sq_map == MAP_FAILED) return fail_mmap("mmap(SQ ring)", why);
        cq_map = single ? sq_map
                        : mmap(nullptr, cq_map_len, PROT_READ | PROT_WRITE,
                               MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
        if (cq_map == MAP_FAILED) return fail_mmap("mmap(CQ ring)", why);
        sqes_len = p.sq_entries * sizeof(io_uring_sqe);
        void* s = mmap(nullptr, sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                       IORING_OFF_SQES);
        if (s == MAP_FAILED) return fail_mmap("mmap(SQEs)", why);
        sqes = static_cast<io_uring_sqe*>(s);
        char* sq = static_cast<char*>(sq_map);
        char* cq = static_cast<char*>(cq_map);
        sq_head = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
        sq_tail = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
        sq_mask = reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
        sq_array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
        cq_head = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
        cq_tail = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
        cq_mask = reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
        cqes = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
        sq_tail_local = *sq_tail;
        return 0;
    }

    int fail_mmap(const char* what, std::string* why) {
        int e = errno;
        *why = errno_str(what, e);
        destroy();
        return -e;
    }

    // Unmaps the rings and closes the fd; idempotent (also run by the destructor).
    void destroy() {
        if (sqes) munmap(sqes, sqes_len);
        if (cq_map != MAP_FAILED && cq_map != sq_map) munmap(cq_map, cq_map_len);
        if (sq_map != MAP_FAILED) munmap(sq_map, sq_map_len);
        if (fd >= 0) close(fd);
        sqes = nullptr;
        sq_map = cq_map = MAP_FAILED;
        fd = -1;
    }

    // A zeroed SQE slot, or nullptr when the SQ ring is full.
    io_uring_sqe* get_sqe() {
        unsigned head = __atomic_load_n(sq_head, __ATOMIC_ACQUIRE);
        if (sq_tail_local - head >= sq_entries) return nullptr;
        unsigned idx = sq_tail_local & *sq_mask;
        io_uring_sqe* sqe = &sqes[idx];
        memset(sqe, 0, sizeof *sqe);
        sq_array[idx] = idx;
        ++sq_tail_local;
        return sqe;
    }

    // Publish produced SQEs; returns how many the kernel has not consumed yet.
    unsigned flush() {
        __atomic_store_n(sq_tail, sq_tail_local, __ATOMIC_RELEASE);
        return sq_tail_local - __atomic_load_n(sq_head, __ATOMIC_ACQUIRE);
    }

    int enter(unsigned to_submit, unsigned min_complete, unsigned enter_flags) {
        int rc = (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, enter_flags,
                              nullptr, 0);
        return rc < 0 ? -errno : rc;
    }

    // Copy out every available CQE and release the slots to the kernel.
    template <class F>
    unsigned reap(F&& on_cqe) {
        unsigned head = *cq_head;  // only we write cq_head
        unsigned tail = __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE);
        unsigned n = 0;
        for (; head != tail; ++head, ++n) {
            const io_uring_cqe& cqe = cqes[head & *cq_mask];
            on_cqe(cqe.user_data, cqe.res);
        }
        __atomic_store_n(cq_head, head, __ATOMIC_RELEASE);
        return n;
    }
};

std::string flags_str(unsigned f) {
    std::string s;
    if (f & IORING_SETUP_SINGLE_ISSUER) s += "SINGLE_ISSUER|";
    if (f & IORING_SETUP_DEFER_TASKRUN) s += "DEFER_TASKRUN|";
    if (f & IORING_SETUP_COOP_TASKRUN) s += "COOP_TASKRUN|";
    if (s.empty()) return "0";
    s.pop_back();
    return s;
}

// Set up a ring with the best flags this kernel accepts (EINVAL = flag unknown there).
int setup_ring_best(Ring* ring, unsigned entries, std::string* why) {
    const unsigned tries[] = {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
                              IORING_SETUP_COOP_TASKRUN, 0};
    int rc = -EINVAL;
    for (unsigned f : tries) {
        rc = ring->init(entries, f, why);
        if (rc != -EINVAL) return rc;
    }
    return rc;
}

unsigned next_pow2(unsigned v) {
    unsigned p = 1;
    while (p < v) p <<= 1;
    return p;
}

class UringEngine final : public Engine {
  public:
    UringEngine(unsigned qd, unsigned block, unsigned iowq_max)
        : Engine(qd, block), iowq_max_(iowq_max) {}
    ~UringEngine() override { shutdown(); }
    const char* name() const override { return "io_uring"; }
    std::string info() const override {
        return "io_uring sq=" + std::to_string(ring_.sq_entries) +
               " cq=" + std::to_string(ring_.cq_entries) + " qd=" + std::to_string(qd_) +
               " flags=" + flags_str(ring_.flags) +
               " iowq_max=" + (iowq_set_ ? std::to_string(iowq_max_) : std::string("default"));
    }

    // Start the ring thread; it sets up the ring itself (SINGLE_ISSUER: the creator
    // must be the submitter). Returns 0 or -errno with `why` filled.
    int start(std::string* why) {
        wake_fd_.reset(eventfd(0, EFD_CLOEXEC));  // blocking: the ring arms poll on it
        if (wake_fd_.get() < 0) {
            int e = errno;
            *why = errno_str("eventfd", e);
            return -e;
        }
        std::promise<std::pair<int, std::string>> ready;
        auto fut = ready.get_future();
        thread_ = std::thread([this, p = std::move(ready)]() mutable { run(&p); });
        auto res = fut.get();
        if (res.first < 0) {
            thread_.join();
            *why = res.second.empty() ? errno_str("io_uring engine setup", -res.first) : res.second;
        }
        return res.first;
    }

  protected:
    void kick_locked() override {
        // Wake the ring thread only if it is (about to be) asleep in io_uring_enter.
        if (ring_sleeping_ && !wake_sent_) {
            wake_sent_ = true;
            uint64_t one = 1;
            ssize_t rc = write(wake_fd_.get(), &one, sizeof one);
            (void)rc;
        }
    }

    void stop_backend() override {
        if (thread_.joinable()) {
            {
                std::lock_guard<std::mutex> lk(mu_);
                quit_ = true;
                ring_sleeping_ = true;  // force the wake below even if a wake is in flight
                wake_sent_ = false;
                kick_locked();
            }
            thread_.join();
        }
        wake_fd_.reset();
    }

  private:
    // Cap the kernel's io-wq workers for this ring. O_DIRECT I/O normally completes
    // without them, but writes that extend a file cannot be issued non-blocking and are
    // punted to io-wq, where many workers just contend for the inode lock: on a 2-core
    // VM the default cap (4 per CPU) burnt ~5x the CPU per GB of a cap of 1-2, for no
    // throughput. Needs Linux 5.15; older kernels keep the default.
    void limit_iowq() {
        unsigned v[2] = {iowq_max_, 0};  // {bounded (file I/O), unbounded}; 0 = unchanged
        const unsigned kRegisterIowqMaxWorkers = 19;  // IORING_REGISTER_IOWQ_MAX_WORKERS
        iowq_set_ = syscall(__NR_io_uring_register, ring_.fd, kRegisterIowqMaxWorkers, v, 2) == 0;
    }

    bool arm_wake() {
        io_uring_sqe* sqe = ring_.get_sqe();
        if (!sqe) return false;
        sqe->opcode = IORING_OP_READ;
        sqe->fd = wake_fd_.get();
        sqe->addr = (uint64_t)(uintptr_t)&g_wake_sink;
        sqe->len = sizeof g_wake_sink;
        sqe->off = 0;
        sqe->user_data = kWakeTag;
        return true;
    }

    void prep_chunk(io_uring_sqe* sqe, Chunk* c) {
        Request* r = c->req;
        sqe->opcode = r->op == kRead ? IORING_OP_READ : IORING_OP_WRITE;
        sqe->fd = r->fd;
        sqe->addr = (uint64_t)(uintptr_t)(r->buf + c->rel + c->done);
        sqe->len = c->len - c->done;
        sqe->off = r->offset + c->rel + c->done;
        sqe->user_data = (uint64_t)(uintptr_t)c;
    }

    // Decide what a CQE means for its chunk: true = chunk finished (err set), false = resubmit.
    static bool on_chunk_cqe(Chunk* c, int res, int* err) {
        Request* r = c->req;
        *err = 0;
        if (res < 0) {
            if ((res == -EINTR || res == -EAGAIN) && ++c->retries < kMaxRetries) return false;
            *err = -res;
            return true;
        }
        if (res == 0) {
            if (r->op == kWrite) *err = EIO;  // a write that makes no progress
            return true;                       // read: EOF
        }
        c->done += (uint32_t)res;
        if (c->done >= c->len) return true;
        if (r->op == kRead && !may_resume_read(c)) return true;  // EOF inside this chunk
        return false;
    }

    // The ring thread: sets the ring up (everything that can throw happens here and is
    // reported through `ready`), then serves it in loop().
    void run(std::promise<std::pair<int, std::string>>* ready) noexcept {
        pthread_setname_np(pthread_self(), "zt-io-ring");
        std::vector<std::pair<Chunk*, int>> cqes;
        std::vector<Chunk*> retry;  // chunks to resubmit (partial transfer or EINTR)
        std::pair<int, std::string> status{0, ""};
        try {
            // One SQ slot for the wake READ, the rest for chunks; CQ is 2x SQ by default,
            // so with at most qd_+1 requests in flight the CQ can never overflow.
            status.first = setup_ring_best(&ring_, next_pow2(qd_ + 1), &status.second);
            if (status.first == 0 && !arm_wake()) status = {-EBUSY, "cannot arm wake eventfd"};
            if (status.first == 0) {
                limit_iowq();
                cqes.reserve(ring_.cq_entries);  // the loop never grows these vectors
                retry.reserve(qd_);
            }
        } catch (...) {  // bad_alloc from the vectors or a message: start() words it
            status.first = -ENOMEM;
        }
        if (status.first < 0) {
            ring_.destroy();
            ready->set_value(std::move(status));
            return;
        }
        ready->set_value(std::move(status));
        loop(cqes, retry);
        // The wake READ may still be armed: closing the ring cancels it.
        ring_.destroy();
    }

    // Serves the ring until shutdown. Allocates nothing (the vectors hold their maximum
    // size: at most cq_entries CQEs per reap, at most qd_ chunks issued).
    void loop(std::vector<std::pair<Chunk*, int>>& cqes, std::vector<Chunk*>& retry) noexcept {
        bool rearm_wake = false;
        for (;;) {
            // 1) Reap completions without the lock (only this thread touches the CQ ring).
            cqes.clear();
            ring_.reap([&](uint64_t ud, int res) {
                if (ud == kWakeTag)
                    rearm_wake = true;
                else
                    cqes.emplace_back(reinterpret_cast<Chunk*>((uintptr_t)ud), res);
            });

            // 2) Account for them and refill the SQ ring under the lock.
            bool completed = false, quit = false;
            {
                std::lock_guard<std::mutex> lk(mu_);
                for (auto& cr : cqes) {
                    int err;
                    if (on_chunk_cqe(cr.first, cr.second, &err)) {
                        --issued_;
                        completed |= finish_chunk_locked(cr.first, err);
                    } else {
                        retry.push_back(cr.first);  // stays counted in issued_
                    }
                }
                if (rearm_wake && !quit_) {
                    wake_sent_ = false;
                    rearm_wake = !arm_wake();  // retry next round if the SQ is full
                }
                while (!retry.empty()) {
                    io_uring_sqe* sqe = ring_.get_sqe();
                    if (!sqe) break;
                    prep_chunk(sqe, retry.back());
                    retry.pop_back();
                }
                while (!pending_.empty() && issued_ < qd_) {
                    io_uring_sqe* sqe = ring_.get_sqe();
                    if (!sqe) break;
                    prep_chunk(sqe, pending_.front());
                    pending_.pop_front();
                    ++issued_;
                }
                // shutdown() sleeps on cv_done_ until nothing is queued or issued
                if (stopping_ && issued_ == 0 && pending_.empty()) completed = true;
                quit = quit_ && issued_ == 0 && pending_.empty();
                ring_sleeping_ = true;  // from here on, new work must wake us
            }
            if (completed) signal_completions();
            if (quit) break;

            // 3) Submit what we queued and sleep until at least one CQE (the wake READ
            //    is always armed, so new work or shutdown can end the sleep).
            unsigned to_submit = ring_.flush();
            int ret = ring_.enter(to_submit, 1, IORING_ENTER_GETEVENTS);
            if (ret == -EBUSY || ret == -EAGAIN) {
                // Kernel short of resources / CQ backlog: wait for completions, then retry.
                ret = ring_.enter(0, 1, IORING_ENTER_GETEVENTS);
            }
            if (ret < 0 && ret != -EINTR && ret != -EBUSY && ret != -EAGAIN) {
                // Not expected from a healthy ring. Do not spin; queued SQEs are retried.
                if (!enter_error_logged_)
                    fprintf(stderr, "zerotier io_uring: io_uring_enter failed: %s (retrying)\n",
                            strerror(-ret));
                enter_error_logged_ = true;
                usleep(1000);
            }
            std::lock_guard<std::mutex> lk(mu_);
            ring_sleeping_ = false;
        }
    }

    Ring ring_;
    const unsigned iowq_max_;
    bool iowq_set_ = false;
    std::thread thread_;
    UniqueFd wake_fd_;
    bool ring_sleeping_ = false, wake_sent_ = false, quit_ = false;  // guarded by mu_
    bool enter_error_logged_ = false;                                // ring thread only
};

// Full io_uring round trip: setup, mmap, opcode probe, one NOP submitted and reaped.
bool uring_probe(std::string* why) {
    FILE* f = fopen("/proc/sys/kernel/io_uring_disabled", "r");
    if (f) {
        int v = 0;
        if (fscanf(f, "%d", &v) == 1 && v == 2) {
            fclose(f);
            *why = "io_uring is disabled by sysctl kernel.io_uring_disabled=2";
            return false;
        }
        fclose(f);
    }
    Ring ring;
    std::string err;
    int rc = ring.init(4, 0, &err);
    if (rc < 0) {
        if (rc == -ENOSYS)
            *why = "kernel has no io_uring (io_uring_setup: ENOSYS)";
        else if (rc == -EPERM)
            *why = "io_uring_setup not permitted (EPERM): kernel.io_uring_disabled "
                   "or a seccomp filter";
        else
            *why = err;
        return false;
    }
    // Which opcodes does this kernel support? (IORING_REGISTER_PROBE, Linux 5.6+)
    size_t plen = sizeof(io_uring_probe) + 256 * sizeof(io_uring_probe_op);
    std::vector<char> mem(plen, 0);
    auto* probe = reinterpret_cast<io_uring_probe*>(mem.data());
    if (syscall(__NR_io_uring_register, ring.fd, IORING_REGISTER_PROBE, probe, 256) < 0) {
        *why = errno_str("io_uring_register(PROBE) (kernel older than 5.6?)", errno);
        return false;
    }
    for (int op : {IORING_OP_READ, IORING_OP_WRITE, IORING_OP_NOP}) {
        if (op > probe->last_op || !(probe->ops[op].flags & IO_URING_OP_SUPPORTED)) {
            *why = "kernel io_uring lacks opcode " + std::to_string(op) + " (READ/WRITE need 5.6+)";
            return false;
        }
    }
    io_uring_sqe* sqe = ring.get_sqe();
    sqe->opcode = IORING_OP_NOP;
    sqe->user_data = 42;
    int ret;
    do {
        ret = ring.enter(ring.flush(), 1, IORING_ENTER_GETEVENTS);
    } while (ret == -EINTR);
    int got = -1;
    ring.reap([&](uint64_t ud, int res) {
        if (ud == 42) got = res;
    });
    if (ret < 0 || got != 0) {
        *why = ret < 0 ? errno_str("io_uring_enter", -ret) : "NOP did not complete";
        return false;
    }
    *why = "ok";
    return true;
}

// Runs body(engine) under zt::guard. A NULL handle or one created by another process
// (a forked child's copy, see [Note: engines after fork]) is refused without touching it.
template <class T, class Body>
T on_engine(const char* fn, void* h, Body&& body) noexcept {
    return zt::guard<T>(fn, ZT_ERR_EXCEPTION, [&]() -> T {
        auto* e = static_cast<Engine*>(h);
        if (!e) return zt::set_error(fn, "NULL engine handle (the engine is closed)"), ZT_ERR_HANDLE;
        if (e->owner() != getpid())
            return zt::set_error(fn, "this I/O engine belongs to process %d and this is its forked child %d, "
                                     "where the engine's threads do not exist; open a new engine in the child",
                                 (int)e->owner(), (int)getpid()),
                   ZT_ERR_FORKED;
        return body(*e);
    });
}

}  // namespace

// ---------------------------------------------------------------------------------------
// C ABI. Handles are opaque pointers. All functions are thread-safe except zt_io_destroy,
// which must not race with any other call on the same handle. Failures other than a
// request's own -errno return ZtStatus codes with the message in zt_io_last_error()
// (see [Note: native error contract] in zt_api.h).

// backend: 0 = io_uring, 1 = threads. Returns nullptr on failure (reason in zt_io_last_error()).
ZT_API void* zt_io_create(int backend, int queue_depth, int threads, uint64_t block_size) {
    const char* fn = "zt_io_create";
    return zt::guard<void*>(fn, nullptr, [&]() -> void* {
        if (queue_depth < 1 || queue_depth > 4096)
            return zt::set_error(fn, "queue_depth must be in [1, 4096], got %d", queue_depth), nullptr;
        if (block_size < 512 || block_size > (1ULL << 30))
            return zt::set_error(fn, "block_size must be in [512 B, 1 GiB], got %llu",
                                 (unsigned long long)block_size), nullptr;
        if (threads < 1 || threads > 1024)
            return zt::set_error(fn, "threads must be in [1, 1024], got %d", threads), nullptr;
        if (backend == kThreads)
            return new ThreadsEngine((unsigned)queue_depth, (unsigned)block_size, (unsigned)threads);
        if (backend == kIoUring) {
            // `threads` caps the kernel's io-wq workers (see limit_iowq), at most one per CPU.
            long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
            unsigned iowq = (unsigned)std::max(1L, std::min<long>(threads, ncpu > 0 ? ncpu : 1));
            auto e = std::make_unique<UringEngine>((unsigned)queue_depth, (unsigned)block_size, iowq);
            std::string msg;
            if (e->start(&msg) < 0) return zt::set_error(fn, "%s", msg.c_str()), nullptr;
            return e.release();
        }
        return zt::set_error(fn, "unknown backend %d", backend), nullptr;
    });
}

// op: 0 = read, 1 = write. Returns a request id (> 0), -errno (the request was refused
// before any I/O: -ENOMEM when it could not be allocated), or a ZtStatus code.
ZT_API int64_t zt_io_submit(void* h, int op, int fd, void* buf, uint64_t nbytes, uint64_t offset) {
    return on_engine<int64_t>("zt_io_submit", h, [&](Engine& e) -> int64_t {
        try {
            return e.submit(op, fd, buf, nbytes, offset);
        } catch (const std::bad_alloc&) {
            return zt::set_error("zt_io_submit", "out of memory for a request of %llu bytes",
                                 (unsigned long long)nbytes), -ENOMEM;
        }
    });
}

// timeout_ms < 0 waits forever. Returns 0 (done: *result = bytes or -errno; the id is
// forgotten), 1 (timed out), -ENOENT (unknown or already consumed id) or a ZtStatus code.
ZT_API int zt_io_wait(void* h, int64_t id, int64_t timeout_ms, int64_t* result) {
    return on_engine<int>("zt_io_wait", h, [&](Engine& e) { return e.wait(id, timeout_ms, result); });
}

// Returns 1 (done: *result set, id forgotten), 0 (running), -ENOENT or a ZtStatus code.
ZT_API int zt_io_poll(void* h, int64_t id, int64_t* result) {
    return on_engine<int>("zt_io_poll", h, [&](Engine& e) { return e.poll(id, result); });
}

// Fail all not-yet-issued chunks with ECANCELED; returns how many were cancelled.
ZT_API int zt_io_cancel(void* h) {
    return on_engine<int>("zt_io_cancel", h, [&](Engine& e) { return e.cancel_pending(); });
}

ZT_API int64_t zt_io_inflight(void* h) {
    return on_engine<int64_t>("zt_io_inflight", h, [&](Engine& e) { return e.inflight_requests(); });
}

// Writes a one-line description of the engine into out[len]. Returns 0 or a ZtStatus code.
ZT_API int zt_io_info(void* h, char* out, int len) {
    return on_engine<int>("zt_io_info", h, [&](Engine& e) {
        copy_out(out, len, e.info());
        return 0;
    });
}

// Waits for all queued and issued chunks, stops threads, frees the handle. Returns 0 or a
// ZtStatus code; a forked child's copy (ZT_ERR_FORKED) is left alone.
ZT_API int zt_io_destroy(void* h) {
    return on_engine<int>("zt_io_destroy", h, [&](Engine& e) {
        delete &e;
        return 0;
    });
}

// 1 if io_uring works here (why = "ok"), 0 with the reason in `why`, or ZT_ERR_EXCEPTION.
ZT_API int zt_io_uring_probe(char* why, int len) {
    return zt::guard<int>("zt_io_uring_probe", ZT_ERR_EXCEPTION, [&] {
        std::string msg;
        bool ok = uring_probe(&msg);
        copy_out(why, len, msg);
        return ok ? 1 : 0;
    });
}

// The calling thread's message for the last failure of an export of this library.
ZT_API const char* zt_io_last_error(void) noexcept { return zt::g_last_error; }

// Bumped with every change of the exported functions; zerotier/io/native.py checks it.
// 2: zt_io_notify_fd removed.
// 3: zt_io_create reports through zt_io_last_error (no `why` buffer); zt_io_destroy returns
//    a status; zt_io_last_error added; ZtStatus codes (ZT_ERR_FORKED, ...) from every call.
ZT_API int zt_io_abi_version(void) noexcept { return 3; }
