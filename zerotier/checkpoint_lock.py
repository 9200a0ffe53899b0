"""The lock of a checkpoint root: one run saves into a root at a time.

[Note: the checkpoint root lock]
Two runs saving into one root replace each other's ckpt-<step> directories and `latest`, and
fail each other's saves half-way (issue 37). As the swap directory is locked (tiers/rundir.py),
an engine takes root/.zerotier-lock at its first save into a root (flock, exclusive,
non-blocking; rank 0, which commits) and writes its owner record into it: pid, host, boot id,
pid start time, run id. It holds the lock until close(), or until its process dies: the kernel
drops a flock with its last file descriptor, so a dead run's lock is never stale and its
record is simply overwritten by the next owner. A second run, another process or another
engine in this process (a flock belongs to one open file, not to a process), is refused at
its first save before anything is written, with the owner named. Reading (load_checkpoint,
zerotier export) takes no lock. A root that disappears (a Trainer's checkpoint-N/zerotier/
deleted by save_total_limit) has its lock dropped at the engine's next save.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import time
import warnings
from pathlib import Path

from .checkpoint_read import CheckpointError
from .tiers.rundir import process_record

LOCK_NAME = ".zerotier-lock"


def _owner(fd: int) -> dict | None:
    try:
        owner = json.loads(os.pread(fd, 1 << 16, 0))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _who(owner: dict | None) -> str:
    if owner is None:
        return "another run (its owner record is not written yet)"
    pid, host = owner.get("pid"), owner.get("hostname")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner["start_time"])) \
        if isinstance(owner.get("start_time"), (int, float)) else "?"
    same = pid == os.getpid() and owner.get("pid_start") == process_record()["pid_start"]
    where = f"another engine in this process (pid {pid})" if same else f"pid {pid} on host {host}"
    return f"{where}, run id {owner.get('run_id')}, saving there since {since}"


class RootLocks:
    """The checkpoint roots an engine holds ([Note: the checkpoint root lock])."""

    def __init__(self):
        self._held: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) of the lock file -> its fd

    def acquire(self, root: Path, run_id: str) -> None:
        """Hold `root`'s lock (created 0600, with `root` 0700 if missing), or refuse naming its owner."""
        from .checkpoint import _mkdir_private
        self._drop_removed()
        path = root / LOCK_NAME
        try:
            _mkdir_private(root)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise CheckpointError(exc.errno, f"save_checkpoint: cannot lock the checkpoint root {root} ({path}: "
                                             f"{exc.strerror or exc}); nothing was written: fix the directory or "
                                             "save to another one") from None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in self._held:
            os.close(fd)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            owner = _owner(fd)
            os.close(fd)
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a filesystem without flock
                warnings.warn(f"save_checkpoint: the checkpoint root {root} cannot be locked ({exc.strerror}): "
                              "another run saving into it would not be detected; give each run its own root",
                              RuntimeWarning, stacklevel=4)
                return
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise CheckpointError(exc.errno, f"save_checkpoint: cannot lock the checkpoint root {root}: "
                                                 f"{exc.strerror}; nothing was written") from None
            raise CheckpointError(errno.EBUSY, f"save_checkpoint: the checkpoint root {root} is in use by {_who(owner)} "
                                               f"(it holds {path}). Two runs saving into one root replace each "
                                               "other's checkpoints and 'latest'; nothing was written. Save to "
                                               "another directory, or stop that run (close() its engine) "
                                               "first") from None
        record = json.dumps({**process_record(), "run_id": run_id}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._held[(st.st_dev, st.st_ino)] = fd

    def _drop_removed(self) -> None:
        """Locks of roots deleted since (st_nlink 0): nothing to guard any more."""
        for key, fd in list(self._held.items()):
            if os.fstat(fd).st_nlink == 0:
                os.close(fd)
                del self._held[key]

    def release(self) -> None:
        """close(): every root this engine saved into is free for another run."""
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()

    __del__ = release  # an engine dropped without close() frees its roots too
