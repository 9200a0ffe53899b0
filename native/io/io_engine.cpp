// zerotier async file I/O engine: a plain C ABI loaded by zerotier/io/native.py (ctypes).
//
// One engine object serves positioned reads/writes of caller-owned memory. Each request is
// split into `block` sized chunks; at most `queue_depth` chunks are in flight at once. Two
// backends, chosen at create time (zt_io_create below), each in its own file; the request
// bookkeeping both share (Request/Chunk, the abstract Engine) is in io/engine.h:
//
//   io_uring  uring_engine.cpp: raw io_uring_setup/io_uring_enter syscalls (no liburing). One
//             "ring thread" owns the ring: it is the only thread that touches the SQ/CQ rings
//             and the only one that calls io_uring_enter. Callers push chunks on a
//             mutex-protected queue and, if the ring thread sleeps, wake it through an eventfd
//             that the ring keeps a READ armed on. See [Note: why one ring thread] there.
//   threads   threads_engine.cpp: a pthread pool; each worker pops a chunk and loops
//             pread/pwrite until done.
//
// Completion: waiters sleep on a condition variable (never spin).
//
// [Note: buffer lifetime] The engine never copies: the caller's buffer must stay alive and
// unmoved from zt_io_submit until the request is observed complete (zt_io_wait/zt_io_poll
// returned it). The Python layer keeps a reference to the tensor in its in-flight table for
// exactly that span. zt_io_destroy waits for every issued chunk before freeing anything.
//
// [Note: engines after fork] fork() copies an engine but not its threads, and the child
// shares the parent's io_uring rings (MAP_SHARED). Each engine remembers the pid that
// created it; in any other process every call on its handle fails with ZT_ERR_FORKED
// without touching it (zt_io_destroy included: the child's copy is leaked on purpose), so a
// forked child can neither hang on requests nobody will complete nor corrupt the parent's
// ring. A child that needs I/O creates its own engine.
//
// Short and partial transfers: see [Note: short transfers] in io/engine.h.

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include <memory>
#include <new>
#include <string>

#include "io/engine.h"
#include "zt_api.h"

namespace {

using zt::io::Engine;

enum BackendKind { kIoUring = 0, kThreads = 1 };

void copy_out(char* out, int len, const std::string& msg) {
    if (out && len > 0) snprintf(out, (size_t)len, "%s", msg.c_str());
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
        if (backend == kThreads) {
            auto e = zt::io::make_threads_engine((unsigned)queue_depth, (unsigned)block_size, (unsigned)threads);
            return e.release();
        }
        if (backend == kIoUring) {
            std::string msg;
            auto e = zt::io::make_uring_engine((unsigned)queue_depth, (unsigned)block_size,
                                               (unsigned)threads, &msg);
            if (!e) return zt::set_error(fn, "%s", msg.c_str()), nullptr;
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
        bool ok = zt::io::uring_probe(&msg);
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
