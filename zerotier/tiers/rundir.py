"""The NVMe tier's run directory: one locked, labelled directory per store, and the
detection of stale ones (see [Note: NVMe layout] in nvme.py).

Swap files live only inside a directory this module created, locked and labelled;
a directory is removed only when it is provably ours and its owner is dead.

[Note: the held run directory]
The run directory is opened once (O_DIRECTORY | O_NOFOLLOW) while it is still private,
before it is renamed to its public name, and every swap file is opened, renamed and
unlinked relative to that fd (openat & co, O_NOFOLLOW). A path is looked up again by
nothing, so another user who can write nvme_path (hostile trial #70) may rename the run
directory or plant a symlink under its name: we keep reading and writing our own
directory. An nvme_path that others can write without the sticky bit is warned about
at creation: they can still delete or rename the run directory (a denial of service).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import time
import warnings
from pathlib import Path

from ..errors import ConfigError, TierIOError

log = logging.getLogger("zerotier.tiers.nvme")

MAGIC = "zerotier-nvme-run-dir/v1"
RUN_PREFIX = "zerotier-"
_OWNER = "owner.json"
_LOCK = ".lock"
_SUFFIX = ".swp"
_TMP_SUFFIX = ".tmp"
_RECYCLED_PREFIX = "%free-"  # never produced by _file_stem ('%' is always followed by 2 hex digits)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_start(pid: int) -> int | None:
    """Start time of pid in clock ticks since boot (tells a reused pid apart), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_record() -> dict:
    """This process as a lock's owner record names it (also the checkpoint root's lock:
    [Note: the checkpoint root lock] in checkpoint_lock.py)."""
    return {"pid": os.getpid(), "hostname": socket.gethostname(), "boot_id": _boot_id(),
            "pid_start": _pid_start(os.getpid()), "start_time": time.time()}


def _read_owner(dir_fd: int) -> dict | None:
    """owner.json of a run dir opened as dir_fd, or None if missing/unreadable/not ours."""
    try:
        fd = os.open(_OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            owner = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and owner.get("magic") == MAGIC else None


def _write_owner(dir_fd: int, owner: dict) -> None:
    """Replace owner.json atomically (write a temporary name, fsync, rename)."""
    tmp = f"{_OWNER}.{os.getpid()}{_TMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps(owner, indent=1).encode())
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, _OWNER, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _is_our_file(name: str) -> bool:
    """Names a run dir may hold; removal never touches anything else."""
    return name in (_OWNER, _LOCK) or name.endswith(_SUFFIX) or name.endswith(_TMP_SUFFIX)


def _remove_contents(dir_fd: int) -> list[str]:
    """Unlink our files in the directory; return the names left behind (not ours)."""
    left = []
    for name in os.listdir(dir_fd):
        if _is_our_file(name):
            try:
                os.unlink(name, dir_fd=dir_fd)
            except IsADirectoryError:
                left.append(name)
            except FileNotFoundError:
                pass
        else:
            left.append(name)
    return left


def _warn_if_shared(parent: Path) -> None:
    """[Note: the held run directory] A world- or group-writable nvme_path without the
    sticky bit lets other users rename or delete our run directory."""
    try:
        mode = os.stat(parent).st_mode
    except OSError:
        return
    if mode & (stat.S_IWOTH | stat.S_IWGRP) and not mode & stat.S_ISVTX:
        who = "anyone" if mode & stat.S_IWOTH else "its group"
        warnings.warn(f"nvme tier: tiers.nvme_path {parent} is writable by {who} without the sticky bit: "
                      f"other users can delete or rename zerotier's run directory there (they cannot "
                      f"make it read their files). Use a private directory, or `chmod +t {parent}`",
                      RuntimeWarning, stacklevel=4)


def _check_parent(parent: Path) -> None:
    """tiers.nvme_path must be an existing directory we can create entries in. A path that is
    not there is a configuration mistake (ConfigError, no raw `[Errno 2]`); other failures are
    the tier's I/O errors."""
    try:
        st = os.stat(parent)
    except FileNotFoundError:
        raise ConfigError(f"tiers.nvme_path {parent} does not exist: create it (mkdir -p {parent}) or set "
                          "tiers.nvme_path to a directory on the NVMe drive") from None
    except OSError as exc:
        raise TierIOError(exc.errno, f"nvme tier: cannot stat tiers.nvme_path {parent}: {exc.strerror}; "
                                     f"fix tiers.nvme_path") from None
    if not stat.S_ISDIR(st.st_mode):
        raise TierIOError(errno.ENOTDIR, f"nvme tier: tiers.nvme_path {parent} is not a directory; "
                                         f"point tiers.nvme_path at a directory on the NVMe drive")


class RunDir:
    """The per-run directory: created locked and labelled, removed on close.

    Holds no reference to the store, so it can be cleaned up by weakref.finalize
    at garbage collection or interpreter exit.
    """

    def __init__(self, path: Path, dir_fd: int, lock_fd: int, owner: dict) -> None:
        self.path = path
        self.dir_fd = dir_fd  # [Note: the held run directory]
        self._lock_fd: int | None = lock_fd
        self._owner = owner
        self._pid = os.getpid()

    # ----------------------------------------------------------------- creation

    @staticmethod
    def _owner_record() -> dict:
        return {"magic": MAGIC, **process_record()}

    @classmethod
    def create(cls, parent: Path) -> "RunDir":
        _check_parent(parent)
        _warn_if_shared(parent)
        final = parent / f"{RUN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        staging = parent / f".{final.name}{_TMP_SUFFIX}"
        try:
            os.mkdir(staging, 0o700)
        except OSError as exc:
            hint = (f"{parent} is not writable: fix its permissions, mount it read-write, "
                    f"or point tiers.nvme_path elsewhere"
                    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else
                    f"free space on {parent} or fix tiers.nvme_path"
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "fix tiers.nvme_path")
            raise TierIOError(exc.errno, f"nvme tier: cannot create run directory {staging}: "
                                         f"{exc.strerror}; {hint}") from None
        lock_fd = dir_fd = -1
        try:
            dir_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            if os.fstat(dir_fd).st_uid != os.geteuid():
                raise OSError(errno.EPERM, f"{staging} was replaced by another user's directory")
            os.chmod(dir_fd, 0o700)  # mkdir's mode is filtered by the umask; be exact
            lock_fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                              | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            owner = cls._owner_record()
            _write_owner(dir_fd, owner)
            os.rename(staging, final)  # appears locked and labelled, never half-made
        except OSError as exc:
            for fd in (lock_fd, dir_fd):
                if fd >= 0:
                    os.close(fd)
            shutil.rmtree(staging, ignore_errors=True)
            raise TierIOError(exc.errno, f"nvme tier: cannot set up run directory {final}: "
                                         f"{exc.strerror}; check tiers.nvme_path") from None
        log.info("nvme tier: run directory %s", final)
        return cls(final, dir_fd, lock_fd, owner)

    # ------------------------------------------------------------------ removal

    def remove(self) -> None:
        """Delete the run dir: only in the creating process, while we hold its lock,
        and only files we create; anything else is left with a warning. Never raises:
        what cannot be removed now (a permission changed under us) is warned about and
        left for the next run on this nvme_path (scan_stale) or for the user."""
        if self._lock_fd is None or os.getpid() != self._pid:
            return  # already removed, or a forked child: not ours to delete
        dir_fd = self.dir_fd
        try:
            owner = _read_owner(dir_fd)
            if owner is None or owner.get("pid") != self._pid:
                warnings.warn(f"nvme tier: not removing {self.path}: its {_OWNER} no longer names this "
                              f"process", RuntimeWarning, stacklevel=2)
                return
            left = _remove_contents(dir_fd)
            if left:
                warnings.warn(f"nvme tier: left {self.path} in place: it holds files zerotier did not "
                              f"create ({', '.join(sorted(left)[:5])})", RuntimeWarning, stacklevel=2)
                return
            self._rmdir()
        except OSError as exc:
            warnings.warn(f"nvme tier: could not remove run directory {self.path}: {exc.strerror or exc}; "
                          f"the next run on this nvme_path removes it (its owner is then dead), or "
                          f"delete it by hand", RuntimeWarning, stacklevel=2)
        finally:
            os.close(dir_fd)
            self._unlock()

    def _rmdir(self) -> None:
        """Remove the (now empty) directory by name, only if that name still is our directory."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            log.warning("nvme tier: run directory %s was renamed or removed by someone else", self.path)
            return
        mine = os.fstat(self.dir_fd)
        if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
            warnings.warn(f"nvme tier: {self.path} is no longer our run directory (something replaced "
                          f"it); not removing it", RuntimeWarning, stacklevel=3)
            return
        os.rmdir(self.path)

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the last fd releases the flock
            self._lock_fd = None


def scan_stale(parent: Path) -> dict[str, list[Path]]:
    """Look for run dirs of dead runs under parent; remove the provably-ours ones.

    A directory is removed only if all hold: a real directory owned by our uid, an
    owner.json with our marker, written on this host, whose lock we can take now,
    and whose owner pid is dead (or reused since: different boot or start time).
    Everything else is reported and kept. Returns {"removed": [...], "kept": [...]}.
    """
    report: dict[str, list[Path]] = {"removed": [], "kept": []}
    try:
        # zerotier-* run dirs, and .zerotier-*.tmp ones a crash left half-made
        names = sorted(n for n in os.listdir(parent) if n.startswith(RUN_PREFIX)
                       or (n.startswith("." + RUN_PREFIX) and n.endswith(_TMP_SUFFIX)))
    except OSError:
        return report
    host, boot = socket.gethostname(), _boot_id()

    def keep(path: Path, why: str, warn: bool = True) -> None:
        report["kept"].append(path)
        if warn:
            warnings.warn(f"nvme tier: found {path} ({why}); leaving it in place. Remove it by hand "
                          f"if it is not in use.", RuntimeWarning, stacklevel=3)
        else:
            log.info("nvme tier: %s: %s", path, why)

    for name in names:
        path = parent / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            keep(path, "not a directory")
            continue
        if st.st_uid != os.geteuid():
            keep(path, f"owned by uid {st.st_uid}, not us")
            continue
        try:
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError as exc:
            keep(path, f"cannot open: {exc.strerror}")
            continue
        lock_fd = -1
        try:
            owner = _read_owner(dir_fd)
            if owner is None:
                # A hidden one may be a run dir another process is creating right now.
                keep(path, "no zerotier owner marker: not provably a zerotier run directory",
                     warn=not name.startswith("."))
                continue
            pid = owner.get("pid")
            if owner.get("hostname") != host:
                keep(path, f"owned by pid {pid} on host {owner.get('hostname')}: cannot tell if it is alive")
                continue
            try:
                lock_fd = os.open(_LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                keep(path, f"in use by live pid {pid} (lock held)", warn=False)
                continue
            except OSError as exc:
                keep(path, f"lock file unusable ({exc.strerror})")
                continue
            same_boot = owner.get("boot_id") == boot and boot != ""
            alive = (same_boot and isinstance(pid, int) and _pid_alive(pid)
                     and _pid_start(pid) == owner.get("pid_start"))
            if alive:
                keep(path, f"owner pid {pid} is alive but does not hold the lock")
                continue
            left = _remove_contents(dir_fd)
            if left:
                keep(path, f"stale (pid {pid} is dead) but holds files zerotier did not create: "
                           f"{', '.join(sorted(left)[:5])}")
                continue
            os.rmdir(path)
            report["removed"].append(path)
            warnings.warn(f"nvme tier: removed stale run directory {path} (owner pid {pid} on this host "
                          f"is dead)", RuntimeWarning, stacklevel=2)
        except OSError as exc:
            keep(path, f"error while checking: {exc.strerror}")
        finally:
            if lock_fd >= 0:
                os.close(lock_fd)
            os.close(dir_fd)
    return report
