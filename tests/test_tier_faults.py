"""Fault paths of the NVMe tier: every error names the tier and the file,
leaves in-memory state intact, and leaves the store usable for other keys."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest
import torch

from zerotier.errors import ConfigError, TierIOError
from zerotier.tiers import NVMeStore

from test_nvme_store import cfgs, store, swap_file  # noqa: F401  (store: the fixture)


def assert_names_file_and_tier(exc, path):
    msg = str(exc.value if hasattr(exc, "value") else exc)
    assert "nvme tier" in msg, msg
    assert str(path) in msg, msg


def still_usable(store):
    x = torch.randn(5000)
    store.write("healthy", x).wait()
    y = torch.empty_like(x)
    store.read("healthy", y).wait()
    assert torch.equal(x, y)


# --------------------------------------------------------------------------- writes

@pytest.mark.parametrize("code,hint", [(errno.ENOSPC, "free space on"), (errno.EIO, "I/O error")])
def test_write_fault_new_key(store, tmp_path, code, hint):
    x = torch.randn(10_000)
    before = x.clone()
    store.engine.inject_fault(op="write", errno=code)
    t = store.write("w", x)
    with pytest.raises(TierIOError) as ei:
        t.wait()
    assert ei.value.errno == code
    assert_names_file_and_tier(ei, store.run_dir / "w.swp")
    assert hint in str(ei.value) and "offset 0" in str(ei.value)
    if code == errno.ENOSPC:
        assert f"free space on {tmp_path} or lower tiers.nvme" in str(ei.value)
    with pytest.raises(TierIOError):  # the outcome is cached: same error again
        t.wait()
    assert torch.equal(x, before)                 # source untouched
    assert store.stats()["files"] == 0 and store.used == 0
    assert list(store.run_dir.glob("w*")) == []   # no half-written file left
    assert store.stats()["errors"] == 1
    still_usable(store)


def test_write_fault_on_rewrite_keeps_old_version(store):
    old, new = torch.randn(3000), torch.randn(3000)
    store.write("k", old).wait()
    store.engine.inject_fault(op="write", errno=errno.ENOSPC)
    with pytest.raises(TierIOError, match="No space left"):
        store.write("k", new).wait()
    out = torch.empty_like(old)
    store.read("k", out).wait()
    assert torch.equal(out, old) and store.used == 12288
    assert sorted(p.name for p in store.run_dir.iterdir() if p.suffix != ".json") == [".lock", "k.swp"]


def test_short_write(store):
    store.engine.inject_fault(op="write", short=True)
    with pytest.raises(TierIOError, match="short write") as ei:
        store.write("s", torch.randn(4096)).wait()  # 16 KiB: half goes through
    assert_names_file_and_tier(ei, store.run_dir / "s.swp")
    assert store.stats()["files"] == 0 and store.used == 0
    still_usable(store)


# ---------------------------------------------------------------------------- reads

def test_read_eio(store):
    x = torch.randn(10_000)
    store.write("r", x).wait()
    store.engine.inject_fault(op="read", errno=errno.EIO)
    y = torch.zeros_like(x)
    with pytest.raises(TierIOError) as ei:
        store.read("r", y).wait()
    assert ei.value.errno == errno.EIO and "I/O error" in str(ei.value)
    assert_names_file_and_tier(ei, swap_file(store, "r"))
    store.read("r", y).wait()  # the fault was transient: the shard is intact
    assert torch.equal(x, y)
    still_usable(store)


def test_short_read_after_truncate(store):
    x = torch.randn(10_000)  # 40000 B -> 40960 B file
    store.write("t", x).wait()
    path = swap_file(store, "t")
    os.truncate(path, 20_000)
    with pytest.raises(TierIOError) as ei:
        store.read("t", torch.empty_like(x)).wait()
    msg = str(ei.value)
    assert "short read: got 20000 of 40960 B" in msg and "file truncated?" in msg
    assert_names_file_and_tier(ei, path)
    still_usable(store)


def test_short_read_injected(store):
    x = torch.randn(8192)
    store.write("i", x).wait()
    store.engine.inject_fault(op="read", short=True)
    with pytest.raises(TierIOError, match="short read: got 16384 of 32768 B"):
        store.read("i", torch.empty_like(x)).wait()


@pytest.mark.parametrize("checksum", ["crc32c"])
def test_checksum_mismatch(tmp_path, checksum):
    with NVMeStore(*cfgs(tmp_path, checksum=checksum)) as s:
        x = torch.randn(10_000)
        s.write("c", x).wait()
        path = swap_file(s, "c")
        with open(path, "r+b") as f:  # flip one bit in the middle of the data
            f.seek(12345)
            b = f.read(1)
            f.seek(12345)
            f.write(bytes([b[0] ^ 0x10]))
        with pytest.raises(TierIOError) as ei:
            s.read("c", torch.empty_like(x)).wait()
        assert ei.value.errno == errno.EBADMSG
        assert "checksum mismatch" in str(ei.value) and s.checksum_algo.split()[0] in str(ei.value)
        assert_names_file_and_tier(ei, path)
        still_usable(s)


def test_corruption_in_padding_is_not_an_error(tmp_path):
    with NVMeStore(*cfgs(tmp_path, checksum="crc32c")) as s:
        x = torch.randn(10)  # 40 B of data, 4056 B of padding
        s.write("p", x).wait()
        with open(swap_file(s, "p"), "r+b") as f:
            f.seek(4000)
            f.write(b"\xff")
        y = torch.empty_like(x)
        s.read("p", y).wait()
        assert torch.equal(x, y)


def test_file_removed_behind_our_back(store):
    store.write("gone", torch.randn(100)).wait()
    path = swap_file(store, "gone")
    os.unlink(path)
    with pytest.raises(TierIOError) as ei:
        store.read("gone", torch.empty(100))
    assert ei.value.errno == errno.ENOENT and "vanished" in str(ei.value)
    assert_names_file_and_tier(ei, path)


# ------------------------------------------------------------------- setup failures

def test_missing_nvme_path(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(ConfigError) as ei:  # a config mistake, not an I/O fault (issue 26 item 7)
        NVMeStore(*cfgs(missing))
    assert "tiers.nvme_path" in str(ei.value) and str(missing) in str(ei.value)
    assert f"mkdir -p {missing}" in str(ei.value)
    assert not missing.exists(), "the error must not create the directory behind the user's back"


def test_nvme_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(TierIOError) as ei:
        NVMeStore(*cfgs(f))
    assert ei.value.errno == errno.ENOTDIR and "not a directory" in str(ei.value)
    assert_names_file_and_tier(ei, f)


def _assert_not_writable(exc, path):
    assert exc.value.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
    assert "not writable" in str(exc.value)
    assert_names_file_and_tier(exc, path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses permission bits; "
                    "test_read_only_dir_immutable/_sysfs cover read-only dirs as root")
def test_read_only_dir_permission_bits(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        with pytest.raises(TierIOError) as ei:
            NVMeStore(*cfgs(ro))
        _assert_not_writable(ei, ro)
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("refused", ["rename and unlink", "even a stat"])
def test_run_directory_unwritable_mid_run_is_a_tier_error(store, tmp_path, monkeypatch, refused):
    """Issue 37 row 16: the run directory made unwritable mid-run (chmod 0500 or 0000 by its owner)
    raised a raw PermissionError from the cleanup of the failed write ('%free-N.swp'), or from the
    stat that looks for the old version, hiding the write's own error. As root chmod stops nothing,
    so the directory's refusals are injected: every rename, unlink (and stat) in it raises EACCES."""
    import zerotier.io as zio
    import zerotier.tiers.nvme as nvme

    old = torch.randn(3000)
    store.write("k", old).wait()
    store.write("k", old + 1).wait()  # the first version's file is kept for reuse: the next write takes it

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(args[0]))
    for name in ("rename", "unlink") + (("stat",) if refused == "even a stat" else ()):
        monkeypatch.setattr(nvme.os if name != "stat" else zio.os, name, denied)
    with pytest.raises(TierIOError) as ei:
        store.write("k", old + 2).wait()
    monkeypatch.undo()
    assert ei.value.errno == errno.EACCES
    assert f"{tmp_path} is not writable: fix its permissions or tiers.nvme_path" in str(ei.value)
    assert_names_file_and_tier(ei, store.run_dir)
    out = torch.empty_like(old)
    store.read("k", out).wait()
    assert torch.equal(out, old + 1)  # the last committed version stays readable


def test_read_only_dir_immutable(tmp_path):
    """As root, an immutable directory (chattr +i) refuses new entries even to root."""
    ro = tmp_path / "imm"
    ro.mkdir()
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(ro)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i unavailable here (needs CAP_LINUX_IMMUTABLE and ext4/xfs/btrfs)")
    try:
        with pytest.raises(TierIOError) as ei:
            NVMeStore(*cfgs(ro))
        _assert_not_writable(ei, ro)
    finally:
        subprocess.run([chattr, "-i", str(ro)], check=True)
    assert list(ro.iterdir()) == []


def test_read_only_dir_sysfs():
    """sysfs refuses mkdir to everyone, root included."""
    if not os.path.isdir("/sys/kernel"):
        pytest.skip("no /sys here")
    with pytest.raises(TierIOError) as ei:
        NVMeStore(*cfgs("/sys/kernel"))
    _assert_not_writable(ei, "/sys/kernel")


def test_zeroed_swap_file_fails_by_default(tmp_path):
    """Swap files are checksummed by default (io.checksum = "crc32c"): a swap file zero-filled or
    planted between steps is an error at its next read, never training data (hostile trial #22)."""
    import zerotier
    from zerotier.models import TinyGPT, batches

    torch.manual_seed(0)
    cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "nvme"},
           "tiers": {"nvme_path": str(tmp_path)}, "train": {"max_grad_norm": 1.0}}
    engine = zerotier.initialize(TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16), cfg)
    data = list(batches(64, 16, 2, 2))
    engine.backward(engine(*data[0]))
    engine.step()
    # both of the unit's master file sets (the speculative step writes the other one: [Note:
    # speculative step]), so whichever is current is zeroed
    for victim in engine.store.run_dir.glob("u00001.master*.swp"):
        victim.write_bytes(bytes(victim.stat().st_size))
    engine.backward(engine(*data[1]))
    with pytest.raises(TierIOError, match="checksum"):
        engine.step()
    with pytest.warns(RuntimeWarning, match=r"could not be put back into the model \(TierIOError.*checksum"):
        engine.close()  # the zeroed master is read again to give the weights back


# ----------------------------------------------- the held run directory (hostile #70, #25)

def test_run_dir_swapped_for_a_symlink_keeps_our_files(tmp_path):
    """Another user renames the run dir aside and plants a symlink to their own directory
    pre-filled with swap files: we keep reading and writing our own directory (the fd held
    since creation), never the planted files."""
    s = NVMeStore(*cfgs(tmp_path, checksum="none"))
    try:
        x = torch.randn(10_000)
        s.write("w", x).wait()
        real = s.run_dir
        aside = tmp_path / "moved-aside"
        os.rename(real, aside)
        planted = tmp_path / "attacker"
        planted.mkdir()
        (planted / "w.swp").write_bytes(b"\0" * os.path.getsize(aside / "w.swp"))
        os.symlink(planted, real)
        y = torch.empty_like(x)
        s.read("w", y).wait()
        assert torch.equal(x, y)               # our bytes, not the planted zeros
        s.write("w2", x * 2).wait()            # new files land in our directory
        assert (aside / "w2.swp").exists() and not (planted / "w2.swp").exists()
        assert (planted / "w.swp").read_bytes().count(0) == os.path.getsize(planted / "w.swp")
    finally:
        with pytest.warns(RuntimeWarning, match="no longer our run directory"):
            s.close()
    assert not (aside / "w.swp").exists() and not (aside / "w2.swp").exists()  # ours cleaned
    assert (planted / "w.swp").exists()                                         # theirs untouched


def test_world_writable_nvme_path_without_sticky_bit_warns(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.warns(RuntimeWarning, match="writable by anyone without the sticky bit"):
        NVMeStore(*cfgs(shared)).close()
    os.chmod(shared, 0o1777)  # like /tmp: no warning
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NVMeStore(*cfgs(shared)).close()


def test_close_with_unremovable_run_dir_warns_and_leaves_it_for_the_next_run(tmp_path, monkeypatch):
    """Hostile #25: a permission changed under the run (simulated: root ignores mode bits)
    makes every unlink fail; close() warns, closes the store and does not raise, and the
    next store on the path removes the left directory once its owner is gone."""
    s = NVMeStore(*cfgs(tmp_path))
    s.write("a", torch.randn(1000)).wait()
    s.write("a", torch.randn(1000)).wait()  # leaves a recycled %free-N.swp
    run_dir = s.run_dir
    real_unlink = os.unlink

    def denied(path, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", path)
    monkeypatch.setattr(os, "unlink", denied)
    with pytest.warns(RuntimeWarning, match="could not remove run directory .*next run on this nvme_path"):
        s.close()
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert run_dir.exists()
    from zerotier.tiers.rundir import scan_stale
    import json
    owner = json.loads((run_dir / "owner.json").read_text())
    owner["pid"] = 2 ** 22 + 7  # as if this process had died: its lock is released already
    (run_dir / "owner.json").write_text(json.dumps(owner))
    with pytest.warns(RuntimeWarning, match="removed stale run directory"):
        report = scan_stale(tmp_path)
    assert run_dir in report["removed"] and not run_dir.exists()


def test_ctrl_c_inside_a_completion_callback_is_raised_once(tmp_path, monkeypatch):
    """Hostile #30: a KeyboardInterrupt landing in a write's completion bookkeeping reaches the
    waiter once; close() then drains, closes and removes the run dir without raising it again."""
    s = NVMeStore(*cfgs(tmp_path))
    real = s.count_in
    fired = []

    def interrupted(nbytes):
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        real(nbytes)
    monkeypatch.setattr(s, "count_in", interrupted)
    t = s.write("k", torch.randn(1000))
    with pytest.raises(KeyboardInterrupt):
        t.wait()
    with pytest.raises(Exception, match="interrupted by KeyboardInterrupt") as later:
        t.wait()
    assert not isinstance(later.value, KeyboardInterrupt)
    run_dir = s.run_dir
    s.close()  # no phantom KeyboardInterrupt
    assert not run_dir.exists()


def _in_thread(fn, seconds=20):
    """fn() on a daemon thread: (finished in time, the exception it raised or None)."""
    import threading
    outcome = []

    def run():
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcome.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), (outcome[0] if outcome else None)


def test_ctrl_c_before_a_completion_callbacks_bookkeeping_does_not_hang_close(tmp_path, monkeypatch):
    """Issue 21: a Ctrl-C landing in a completion callback before it took its ticket off the
    in-flight set left it there: close() waited on it forever (and so did the next write of the
    same key). Both finish now; the interrupt reached the waiter once."""
    s = NVMeStore(*cfgs(tmp_path))
    real = s._io_error
    fired = []

    def interrupted(*args):
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(s, "_io_error", interrupted)  # runs in the write's finish, before its bookkeeping
    s.engine.inject_fault(op="write", errno=errno.EIO)
    t = s.write("k", torch.randn(1000))
    with pytest.raises(KeyboardInterrupt):
        t.wait()
    finished, error = _in_thread(lambda: s.write("k", torch.ones(1000)).wait())  # the same key again
    assert finished and error is None, error
    out = torch.empty(1000)
    s.read("k", out).wait()
    assert torch.equal(out, torch.ones(1000))
    run_dir = s.run_dir
    finished, error = _in_thread(s.close)
    assert finished, "close() hangs"
    assert error is None and not run_dir.exists()


def test_ctrl_c_landing_while_close_drains_is_raised_after_cleanup(tmp_path, monkeypatch):
    """A Ctrl-C that first lands in a completion callback close() is draining: close() still removes
    the run directory (bounded), then raises it."""
    s = NVMeStore(*cfgs(tmp_path))
    fired = []

    def interrupted(*args):
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
    monkeypatch.setattr(s, "_io_error", interrupted)
    s.engine.inject_fault(op="write", errno=errno.EIO)
    s.write("k", torch.randn(1000))  # never waited: close() drains it
    run_dir = s.run_dir
    finished, error = _in_thread(s.close)
    assert finished, "close() hangs"
    assert isinstance(error, KeyboardInterrupt) and not run_dir.exists()
