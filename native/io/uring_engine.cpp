// The I/O engine's io_uring backend: raw io_uring_setup/io_uring_enter/io_uring_register
// syscalls (no liburing), the Ring that maps them, UringEngine with its one ring thread, and
// the probe behind zt_io_uring_probe. Request bookkeeping is the shared Engine
// (io/engine.h); the entry points are make_uring_engine and uring_probe, called from
// io_engine.cpp.
//
// [Note: why one ring thread] io_uring posts completions through task_work queued on the
// task that *submitted* the request. If Python threads submitted directly, completions would
// interrupt them, and a submitting thread that exits could get its requests cancelled. With
// a single owner thread, all task_work runs inside that thread's io_uring_enter(GETEVENTS),
// which also lets us ask for IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN.

#include <linux/io_uring.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "io/engine.h"

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

namespace zt {
namespace io {
namespace {

constexpr uint64_t kWakeTag = ~0ULL;        // user_data of the ring's wake-eventfd READ
// Where the wake READ lands. The value is never used; a static avoids any question of the
// kernel writing into a freed engine if a READ is still armed when the ring is torn down.
uint64_t g_wake_sink;

std::string errno_str(const char* what, int err) {
    return std::string(what) + ": " + strerror(err);
}

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

}  // namespace

std::unique_ptr<Engine> make_uring_engine(unsigned qd, unsigned block, unsigned threads,
                                          std::string* why) {
    // `threads` caps the kernel's io-wq workers (see limit_iowq), at most one per CPU.
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned iowq = (unsigned)std::max(1L, std::min<long>(threads, ncpu > 0 ? ncpu : 1));
    auto e = std::make_unique<UringEngine>(qd, block, iowq);
    if (e->start(why) < 0) return nullptr;
    return e;
}

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

}  // namespace io
}  // namespace zt
