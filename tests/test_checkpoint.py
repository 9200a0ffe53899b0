"""Checkpoints (zerotier/checkpoint.py, checkpoint_read.py): exact resume, placement /
world-size changes, atomicity under SIGKILL and ENOSPC, corruption, export, and the
streaming memory bound.

Resume on one process with the CPU fp32 path is bitwise (the same kernels see the same
inputs); across world sizes it is within 1e-5 (gradient averaging changes summation order).
"""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch

import zerotier
from zerotier import checkpoint, checkpoint_read, export
from zerotier.measure import PeakRSS
from zerotier.checkpoint_read import CheckpointError
from zerotier.dist import spawn
from zerotier.errors import TierIOError, ZerotierError
from zerotier.models import TinyGPT, batches

VOCAB, SEQ, BATCH, ACCUM, CLIP, LR = 64, 16, 4, 2, 1.0, 3e-3
HOST = {"params": "device", "gradients": "device", "optimizer": "host"}
NVME = {"params": "device", "gradients": "host", "optimizer": "nvme"}


def make_model(dim=32):
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=dim, layers=2, heads=2, seq=SEQ)


def config(offload, nvme_dir, stage=0):
    return {"optimizer": {"lr": LR, "weight_decay": 0.01}, "offload": offload,
            "tiers": {"nvme_path": str(nvme_dir)},
            "zero": {"stage": stage, "persistence_threshold": 200, "reduce_bucket_size": 4096},
            "train": {"grad_accum_steps": ACCUM, "max_grad_norm": CLIP}}


def micro_batches(start_step, steps, rank=0, world=1):
    """The micro-batches of optimizer steps [start_step, start_step + steps), this rank's part."""
    data = list(batches(VOCAB, SEQ, BATCH, (start_step + steps) * ACCUM, seed=3))[start_step * ACCUM:]
    half = BATCH // world
    return [(x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]) for x, y in data]


def train(engine, start_step, steps, rank=0, world=1):
    for x, y in micro_batches(start_step, steps, rank, world):
        engine.backward(engine(x, y))
        engine.step()


def assert_same(a, b, exact=True):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            # across world sizes: summation order differs, Adam amplifies it to a few 1e-6 abs
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """20 optimizer steps without interruption, saving after 10 (with optimizer on host and NVMe)."""
    out = {}
    for name, offload in (("host", HOST), ("nvme", NVME)):
        root = tmp_path_factory.mktemp(f"ck-{name}")
        with zerotier.initialize(make_model(), config(offload, root)) as engine:
            train(engine, 0, 10)
            engine.save_checkpoint(root / "ck", client_state={"epoch": 7})
            train(engine, 10, 10)
            out[name] = (root / "ck", engine.parameters_fp32())
    return out


@pytest.mark.parametrize("saved,loaded", [("host", "host"), ("nvme", "nvme"), ("nvme", "host"),
                                          ("host", "nvme")])
def test_resume_is_exact(uninterrupted, saved, loaded, tmp_path):
    root, expected = uninterrupted[saved]
    with zerotier.initialize(make_model(), config(NVME if loaded == "nvme" else HOST, tmp_path)) as engine:
        client = engine.load_checkpoint(root)
        assert client == {"epoch": 7}
        assert engine.global_steps == 10 and engine.micro_steps == 20
        train(engine, 10, 10)
        assert_same(engine.parameters_fp32(), expected, exact=True)


def test_layout_and_retention(tmp_path):
    root = tmp_path / "ck"
    with zerotier.initialize(make_model(), config(HOST, tmp_path)) as engine:
        sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, 1, gamma=0.5)
        for step in range(4):
            train(engine, step, 1)
            sched.step()
            engine.save_checkpoint(root, lr_scheduler=sched)
        engine.save_checkpoint(root, lr_scheduler=sched)  # same step again: replaced safely
    with zerotier.initialize(make_model(), config(HOST, tmp_path)) as engine:
        sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, 1, gamma=0.5)
        engine.load_checkpoint(root, lr_scheduler=sched)
        assert engine.optimizer.param_groups[0]["lr"] == LR / 16 and sched.last_epoch == 4
    assert (root / "latest").read_text().strip() == "ckpt-4"
    assert sorted(p.name for p in root.iterdir()) == [".zerotier-lock", "ckpt-3", "ckpt-4", "latest"]
    manifest = json.loads((root / "ckpt-4" / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["global_steps"] == 4
    root_unit = next(u for u in manifest["units"] if u["name"] == "")  # tok, head (tied), pos, ln_f
    assert ["tok.weight", "head.weight"] in [p["names"] for p in root_unit["params"]]  # tied: both names
    assert {r["key"] for r in manifest["ranks"][0]["records"]} == {"master", "exp_avg", "exp_avg_sq"}


# ------------------------------------------------------------------ world size changes

def dist_save(rank, world, root, nvme_dir):
    torch.set_num_threads(1)  # 2 ranks on small CI machines
    saved = {}
    for stage in (1, 3):
        with zerotier.initialize(make_model(), config(NVME if stage == 3 else HOST, nvme_dir, stage)) as engine:
            train(engine, 0, 5, rank, world)
            engine.save_checkpoint(os.path.join(root, f"stage{stage}"))
            saved[stage] = engine.parameters_fp32()
    return saved


def dist_load(rank, world, root, nvme_dir):
    torch.set_num_threads(1)
    with zerotier.initialize(make_model(), config(HOST, nvme_dir, 2)) as engine:
        engine.load_checkpoint(root)
        loaded = engine.parameters_fp32()
        train(engine, 5, 5, rank, world)
        return loaded, engine.parameters_fp32()


def test_world_size_changes(tmp_path):
    with zerotier.initialize(make_model(), config(HOST, tmp_path)) as engine:
        train(engine, 0, 10)
        expected = engine.parameters_fp32()
    # 2 ranks (stages 1 and 3) -> 1 process: the loaded state is exactly the saved one
    saved = spawn(dist_save, 2, str(tmp_path / "two"), str(tmp_path), timeout_s=300)[0]
    for stage in (1, 3):
        with zerotier.initialize(make_model(), config(HOST, tmp_path)) as engine:
            engine.load_checkpoint(tmp_path / "two" / f"stage{stage}")
            assert_same(engine.parameters_fp32(), saved[stage], exact=True)
            train(engine, 5, 5)
            assert_same(engine.parameters_fp32(), expected, exact=False)
    # 1 process (optimizer on NVMe) -> 2 ranks at stage 2
    with zerotier.initialize(make_model(), config(NVME, tmp_path)) as engine:
        train(engine, 0, 5)
        engine.save_checkpoint(tmp_path / "one")
        at_save = engine.parameters_fp32()
    results = spawn(dist_load, 2, str(tmp_path / "one"), str(tmp_path), timeout_s=300)
    for loaded, weights in results:
        assert_same(loaded, at_save, exact=True)
        assert_same(weights, expected, exact=False)


# ------------------------------------------------------------------ atomicity and errors

KILLED_SAVER = r"""
import sys, time, torch, zerotier
from zerotier import checkpoint, export
sys.path.insert(0, {tests!r})
from test_checkpoint import make_model, config, train, HOST
real = checkpoint._write_record
def slow(eng, fd, buf, offset, path):
    ticket = real(eng, fd, buf, offset, path)
    ticket.wait()
    print("writing", flush=True)
    time.sleep(0.2)
    return ticket
checkpoint._write_record = slow
engine = zerotier.initialize(make_model(), config(HOST, {tmp!r}))
engine.load_checkpoint({root!r})
train(engine, 1, 1)
engine.save_checkpoint({root!r})
print("finished", flush=True)
"""


def test_sigkill_during_save_keeps_previous(tmp_path):
    root = tmp_path / "ck"
    with zerotier.initialize(make_model(), config(HOST, tmp_path)) as engine:
        train(engine, 0, 1)
        engine.save_checkpoint(root)
        expected = engine.parameters_fp32()
    script = KILLED_SAVER.format(tests=os.path.dirname(__file__), tmp=str(tmp_path), root=str(root))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(5):  # a few records into the save
            line = child.stdout.readline()
            assert line.startswith("writing"), line
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    assert any(p.name.startswith(".ckpt-2.tmp-") for p in root.iterdir())  # killed mid-save
    assert (root / "latest").read_text().strip() == "ckpt-1"
    with zerotier.initialize(make_model(), config(HOST, tmp_path)) as engine:
        engine.load_checkpoint(root)
        assert engine.global_steps == 1
        assert_same(engine.parameters_fp32(), expected)
        train(engine, 1, 1)
        engine.save_checkpoint(root)  # the next save cleans the leftover
    assert sorted(p.name for p in root.iterdir()) == [".zerotier-lock", "ckpt-1", "ckpt-2", "latest"]


def test_enospc_during_save(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    with zerotier.initialize(make_model(), config(NVME, tmp_path)) as engine:
        train(engine, 0, 1)
        engine.save_checkpoint(root)
        expected = engine.parameters_fp32()
        train(engine, 1, 1)
        calls = []
        real = checkpoint._write_record

        def full_disk(eng, fd, buf, offset, path):
            calls.append(1)
            if len(calls) > 4:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(eng, fd, buf, offset, path)
        monkeypatch.setattr(checkpoint, "_write_record", full_disk)
        with pytest.raises(TierIOError) as info:
            engine.save_checkpoint(root)
        msg = str(info.value)
        assert str(root) in msg and "free space" in msg and "no space left" in msg
        monkeypatch.setattr(checkpoint, "_write_record", real)
    assert sorted(p.name for p in root.iterdir()) == [".zerotier-lock", "ckpt-1", "latest"]
    with zerotier.initialize(make_model(), config(HOST, tmp_path)) as engine:
        engine.load_checkpoint(root)
        assert_same(engine.parameters_fp32(), expected)


def test_corrupt_file_is_named(uninterrupted, tmp_path):
    import shutil
    src, _ = uninterrupted["host"]
    root = tmp_path / "ck"
    shutil.copytree(src, root)
    data_file = root / "ckpt-10" / "rank0.bin"
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data_file.write_bytes(raw)
    with zerotier.initialize(make_model(), config(HOST, tmp_path)) as engine:
        with pytest.raises(TierIOError, match=r"rank0\.bin: checksum mismatch in u\d{5}\.\w+ at offset \d+"):
            engine.load_checkpoint(root)


def test_fingerprint_mismatch(uninterrupted, tmp_path):
    root, _ = uninterrupted["host"]
    with zerotier.initialize(make_model(dim=48), config(HOST, tmp_path)) as engine:
        with pytest.raises(ZerotierError, match=r"does not match this model: the first difference is unit 0"):
            engine.load_checkpoint(root)


def test_save_inside_accumulation_window(tmp_path):
    with zerotier.initialize(make_model(), config(HOST, tmp_path)) as engine:
        x, y = micro_batches(0, 1)[0]
        engine.backward(engine(x, y))
        engine.step()
        with pytest.raises(ZerotierError, match="accumulation window"):
            engine.save_checkpoint(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


# ------------------------------------------------------------------ export

def test_consolidated_state_dict_and_export(uninterrupted, tmp_path):
    root, _ = uninterrupted["nvme"]
    x, _ = micro_batches(0, 1)[0]
    with zerotier.initialize(make_model(), config(NVME, tmp_path)) as engine:
        engine.load_checkpoint(root / "ckpt-10")
        engine.eval()
        with torch.no_grad():
            want = engine(x)
        sd = engine.consolidated_state_dict()
    fresh = make_model()
    fresh.load_state_dict(sd, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(x), want)

    from safetensors.torch import load_file  # the format's own reader (a test dependency, via transformers)
    for out, load in (("m.safetensors", load_file), ("m.pt", torch.load)):
        path = tmp_path / out
        subprocess.run([sys.executable, "-m", "zerotier.cli", "export", str(root), "--to", str(path)],
                       check=True, capture_output=True)
        exported = load(path)
        assert exported.keys() == sd.keys()
        for k in sd:
            assert exported[k].shape == sd[k].shape and torch.equal(exported[k], sd[k]), k
    export.export(root, tmp_path / "h.safetensors", "bf16")
    half = load_file(tmp_path / "h.safetensors")
    assert half["tok.weight"].dtype == torch.bfloat16
    assert torch.equal(half["tok.weight"], sd["tok.weight"].to(torch.bfloat16))


# ------------------------------------------------------------------ streaming memory bound

def test_streaming_memory_bound(tmp_path):
    torch.manual_seed(0)
    # 40 units of 12 MB of state: the streaming window (a few units, plus what the allocator keeps
    # of freed buffers: 47-75 MB seen) must stay far below the 503 MB the state would take whole
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(40)))
    state_bytes = 3 * 4 * sum(p.numel() for p in model.parameters())
    assert state_bytes >= 500e6
    cfg = {"offload": HOST, "tiers": {"nvme_path": str(tmp_path)}}
    with zerotier.initialize(model, cfg) as engine:
        exp_avg = [engine.unit_optimizer.state.read_state(u)["exp_avg"] for u in engine.units]  # host: the live tensors
        for t in exp_avg:
            t.fill_(0.5)
        with PeakRSS(interval=0.002) as save_mem:
            t0 = time.perf_counter()
            engine.save_checkpoint(tmp_path / "ck")
            save_s = time.perf_counter() - t0
        for t in exp_avg:
            t.zero_()
        with PeakRSS(interval=0.002) as load_mem:
            t0 = time.perf_counter()
            engine.load_checkpoint(tmp_path / "ck")
            load_s = time.perf_counter() - t0
        assert all(bool((t == 0.5).all()) for t in exp_avg)
    mb = state_bytes / 1e6
    print(f"\ncheckpoint of {mb:.0f} MB: save {save_s:.2f} s ({mb / save_s:.0f} MB/s, RSS +"
          f"{save_mem.growth / 1e6:.0f} MB), load {load_s:.2f} s ({mb / load_s:.0f} MB/s, RSS +"
          f"{load_mem.growth / 1e6:.0f} MB)")
    assert save_mem.growth < state_bytes / 4
    assert load_mem.growth < state_bytes / 4


# ------------------------------------------------------------------ checkpoints hold data, not code

class _Plant:
    """Unpickling this creates a file: what a crafted state.pt would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _forge_state_pt(ckpt, payload) -> None:
    """Replace ckpt/state.pt by a pickle of `payload` and fix the manifest's size and crc32c."""
    import io
    import crc32c as crc
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    (ckpt / "state.pt").write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["state"] = {"nbytes": len(data), "crc32c": crc.crc32c(data)}
    manifest["crc32c"] = checkpoint_read.manifest_crc(manifest)  # the manifest's checksum: anyone can compute it too
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_crafted_checkpoint_cannot_run_code_on_load_or_export(tmp_path):
    root = tmp_path / "ck"
    with zerotier.initialize(make_model(), config(HOST, tmp_path)) as engine:
        train(engine, 0, 1)
        ckpt = engine.save_checkpoint(root)
    planted = tmp_path / "PWNED"
    _forge_state_pt(ckpt, {"global_steps": 1, "client_state": _Plant(str(planted))})
    with zerotier.initialize(make_model(), config(HOST, tmp_path)) as engine:
        with pytest.raises(CheckpointError, match="outside torch's safe set.*trust_pickle=True"):
            engine.load_checkpoint(root)
        assert engine.window.broken is None  # nothing was loaded: the engine goes on
        train(engine, 0, 1)
    with pytest.raises(CheckpointError, match="outside torch's safe set"):
        export.export(root, tmp_path / "w.safetensors")
    assert not planted.exists(), "unpickling ran the planted code"


def test_client_state_that_is_not_data_is_refused_at_save(tmp_path):
    root = tmp_path / "ck"
    with zerotier.initialize(make_model(), config(HOST, tmp_path)) as engine:
        train(engine, 0, 1)
        with pytest.raises(CheckpointError, match="client_state holds objects that cannot be loaded back safely"):
            engine.save_checkpoint(root, client_state={"fn": make_model})
        assert not root.exists() or not any(root.iterdir()), "a refused save left files behind"
        engine.save_checkpoint(root, client_state={"epoch": 3, "losses": [1.0, 0.5], "note": "ok", "t": torch.ones(2)})
        assert engine.load_checkpoint(root)["epoch"] == 3


# -------------------------------------------- retention, ownership and modes (hostile #42, #43, #47, #75)

def _engine(tmp_path):
    return zerotier.initialize(make_model(), config(HOST, tmp_path))


def test_retention_keeps_the_newest_of_this_run_and_never_another_run(tmp_path):
    """#43: a root holding ckpt-100/101 of an earlier run: the current run keeps its own newest
    `keep`, the earlier run's checkpoints stay (another run's, not ours to prune)."""
    root = tmp_path / "ckpts"
    stale = _engine(tmp_path)
    for step in (100, 101):
        stale.runtime.steps.global_steps = step
        stale.save_checkpoint(root)
    stale.close()
    engine = _engine(tmp_path)
    for step in range(1, 5):
        train(engine, step - 1, 1)
        engine.save_checkpoint(root)
    assert sorted(p.name for p in root.iterdir()) == [".zerotier-lock", "ckpt-100", "ckpt-101", "ckpt-3", "ckpt-4", "latest"]
    engine.save_checkpoint(root, keep=None)   # same step again: replaces ckpt-4, keeps all
    train(engine, 4, 1)
    engine.save_checkpoint(root, keep=1)
    assert sorted(p.name for p in root.iterdir()) == [".zerotier-lock", "ckpt-100", "ckpt-101", "ckpt-5", "latest"]
    with pytest.raises(ZerotierError, match="keep is how many"):
        engine.save_checkpoint(root, keep=0)
    engine.close()
    resumed = _engine(tmp_path)                 # a resumed run continues the lineage of ckpt-5
    resumed.load_checkpoint(root)
    train(resumed, 5, 1)
    resumed.save_checkpoint(root, keep=1)
    assert sorted(p.name for p in root.iterdir()) == [".zerotier-lock", "ckpt-100", "ckpt-101", "ckpt-6", "latest"]
    resumed.close()


def test_foreign_directory_named_like_a_checkpoint_is_never_deleted(tmp_path):
    """#42: another tool's `ckpt-2` directory (or a file of that name) is refused at save with
    nothing written; a `ckpt-1` holding a stray manifest.json + notes is not pruned."""
    root = tmp_path / "ckpts"
    (root / "ckpt-1").mkdir(parents=True)
    (root / "ckpt-1" / "manifest.json").write_text('{"format": 1}')
    (root / "ckpt-1" / "notes.txt").write_text("mine")
    (root / "ckpt-2").mkdir()
    (root / "ckpt-2" / "model.pt").write_bytes(b"weights of another tool")
    (root / "ckpt-3").write_text("a file")
    engine = _engine(tmp_path)
    before = sorted(p.name for p in root.iterdir())
    for step in (2, 3):
        engine.runtime.steps.global_steps = step
        with pytest.raises(CheckpointError, match=f"ckpt-{step} exists and is not a zerotier checkpoint"):
            engine.save_checkpoint(root)
        assert sorted(p.name for p in root.iterdir()) == before  # nothing written, nothing left
    for step in (4, 5, 6):
        engine.runtime.steps.global_steps = step
        engine.save_checkpoint(root, keep=1)
    assert sorted(p.name for p in root.iterdir()) == [".zerotier-lock", "ckpt-1", "ckpt-2", "ckpt-3", "ckpt-6", "latest"]
    assert (root / "ckpt-2" / "model.pt").read_bytes() == b"weights of another tool"
    assert (root / "ckpt-1" / "notes.txt").read_text() == "mine"
    engine.close()


def test_checkpoint_files_are_private_whatever_the_umask(tmp_path):
    """#47: 0700 directories and 0600 files under umask 0, like the swap directory."""
    old = os.umask(0)
    try:
        engine = _engine(tmp_path)
        ckpt = engine.save_checkpoint(tmp_path / "new-root")
        engine.close()
    finally:
        os.umask(old)
    root = ckpt.parent
    assert os.stat(root).st_mode & 0o777 == 0o700 and os.stat(ckpt).st_mode & 0o777 == 0o700
    for f in [root / "latest", *ckpt.iterdir()]:
        assert os.stat(f).st_mode & 0o777 == 0o600, f


# the advice steps a fresh scheduler before this engine's first step: torch's first-step check warns of it
@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`:UserWarning")
def test_load_with_a_scheduler_the_checkpoint_lacks_changes_nothing_and_its_advice_resumes_exactly(tmp_path):
    """#75: the error comes before anything is loaded. Issue 37 row 3: its advice was to load without
    the scheduler, which restarts the schedule (trains differently); the advice now given (build the
    scheduler, load without it, step it to the checkpoint's step) resumes the lr exactly."""
    def schedule(step):
        return min(1.0, (step + 1) / 3) * 0.7 ** step

    engine = _engine(tmp_path)
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule)
    for step in range(3):
        train(engine, step, 1)
        sched.step()
        if step == 1:
            engine.save_checkpoint(tmp_path / "ckpts")  # without the scheduler
    expected_lr = engine.optimizer.param_groups[0]["lr"]   # what step 4 uses
    expected = engine.parameters_fp32()
    engine.close()

    engine = _engine(tmp_path)
    train(engine, 0, 1)
    before = {k: v.clone() for k, v in engine.parameters_fp32().items()}
    steps = engine.global_steps
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
    with pytest.raises(ZerotierError, match="holds no lr scheduler state.*nothing was loaded.*would train "
                                            "differently.*call scheduler.step\\(\\) 2 times"):
        engine.load_checkpoint(tmp_path / "ckpts", lr_scheduler=sched)
    assert engine.global_steps == steps
    assert_same(before, engine.parameters_fp32())
    train(engine, 1, 1)  # still usable
    engine.close()

    engine = _engine(tmp_path)                    # the advice, followed
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule)
    engine.load_checkpoint(tmp_path / "ckpts")
    for _ in range(engine.global_steps):
        sched.step()
    engine.set_lr_scheduler(sched)
    last_step_lands_as_before(engine, expected_lr, expected)


def last_step_lands_as_before(engine, expected_lr, expected):
    """Step 2, the last of the uninterrupted run, ends on its lr and weights; closes the engine."""
    train(engine, 2, 1)
    assert engine.optimizer.param_groups[0]["lr"] == expected_lr
    assert_same(expected, engine.parameters_fp32())
    engine.close()


def test_load_without_the_scheduler_a_checkpoint_carries_warns_and_setting_it_first_resumes_exactly(tmp_path):
    """Issue 37 follow-up: a checkpoint saved with an lr scheduler, loaded into an engine with none set
    and no lr_scheduler=, silently restarted the schedule. It warns now, naming the fix (set the
    scheduler before loading); following it resumes the lr and weights exactly, without the warning."""
    def schedule(step):
        return min(1.0, (step + 1) / 3) * 0.7 ** step

    engine = _engine(tmp_path)
    engine.set_lr_scheduler(torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule))
    for step in range(3):
        train(engine, step, 1)
        if step == 1:
            engine.save_checkpoint(tmp_path / "ckpts")  # carries the engine's scheduler
    expected_lr = engine.optimizer.param_groups[0]["lr"]
    expected = engine.parameters_fp32()
    engine.close()

    engine = _engine(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"carries lr scheduler state, but no lr_scheduler= was given and the "
                                            r"engine has none set, so it is not restored.*Set the scheduler before "
                                            r"loading: engine.set_lr_scheduler\(sched\) or load_checkpoint\(root, "
                                            r"lr_scheduler=sched\) \(see docs/checkpoint.md\)"):
        engine.load_checkpoint(tmp_path / "ckpts")
    assert engine.global_steps == 2  # loaded all the same
    engine.close()

    for given in (False, True):  # the fix, both ways: no warning, the schedule resumes
        engine = _engine(tmp_path)
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            if given:
                engine.load_checkpoint(tmp_path / "ckpts", lr_scheduler=sched)
            else:
                engine.set_lr_scheduler(sched)
                engine.load_checkpoint(tmp_path / "ckpts")
        if given:
            engine.set_lr_scheduler(sched)
        last_step_lands_as_before(engine, expected_lr, expected)


# ------------------------------------ reading bad checkpoints (hostile #36, #38, #39, #44, #45)

def _saved(tmp_path):
    """A checkpoint root holding ckpt-1, and ckpt-1."""
    engine = _engine(tmp_path)
    train(engine, 0, 1)
    ckpt = engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    return ckpt.parent, ckpt


def _reseal(ckpt, manifest) -> None:
    """Write `manifest` back with its checksum fixed, as anyone editing it can."""
    manifest["crc32c"] = checkpoint_read.manifest_crc(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_manifest_checksum_catches_every_one_bit_flip(tmp_path):
    """#36: the manifest carries its own crc32c; of every one-bit flip of a real manifest,
    each is refused or changed no value (e.g. 1e-05 -> 1E-05). A manifest without the key
    (written before it existed) loads as before."""
    root, ckpt = _saved(tmp_path)
    raw = (ckpt / "manifest.json").read_bytes()
    original = json.loads(raw)
    steps_at = raw.index(b'"unit_steps": [[') + len(b'"unit_steps": [[')
    flipped = bytearray(raw)
    flipped[steps_at] ^= 1  # the reported case: a step count '1' -> '0'
    (ckpt / "manifest.json").write_bytes(flipped)
    with pytest.raises(CheckpointError, match=r"manifest\.json: checksum mismatch — the manifest is "
                                              r"corrupt or was edited; load an earlier checkpoint"):
        export.export(root, tmp_path / "w.safetensors")
    key_at = raw.rindex(b'"crc32c": ') + 1
    for bit in range(len(raw) * 8):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        (ckpt / "manifest.json").write_bytes(flipped)
        try:
            got = checkpoint_read.read_manifest(ckpt)
        except CheckpointError:
            continue
        # loaded: the flip renamed the checksum's own key (so it is unchecked) or turned an
        # exponent's e into E; either way every value is what was saved
        assert key_at <= bit // 8 < key_at + len("crc32c") or raw[bit // 8] in b"eE", bit
        assert {k: got.get(k) for k in original if k != "crc32c"} == \
               {k: v for k, v in original.items() if k != "crc32c"}, f"bit {bit} changed the manifest silently"
    del original["crc32c"]
    (ckpt / "manifest.json").write_text(json.dumps(original))
    export.export(root, tmp_path / "w.safetensors")


def test_manifest_edited_with_its_checksum_fixed(tmp_path):
    """A manifest edited and resealed (its checksum recomputed): its shape is checked, so a
    wrong value is a CheckpointError naming it, not a KeyError or a read past a record."""
    root, ckpt = _saved(tmp_path)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    edits = [(lambda m: m["ranks"][0]["ranges"][0].__setitem__(1, m["units"][0]["numel"] + 1),
              r"ranks\[0\]\.ranges\[0\] = \[0, \d+\) is outside unit 0's \d+ elements"),
             (lambda m: m["ranks"][0]["records"].pop(), r"ranks\[0\] lacks records: 8 of 9"),
             (lambda m: m["unit_steps"][0].append(7), r"unit_steps\[0\] is .*, not a list of \d+ ints"),
             (lambda m: m.__setitem__("world_size", "2"), r"world_size is '2', not a count >= 1"),
             # the update rule's name, not hashable (test_fuzz found a TypeError here)
             (lambda m: m.__setitem__("optimizer", []), r"optimizer is \[\], not one of adamw, adam, lion")]
    for edit, message in edits:
        edited = json.loads(json.dumps(manifest))
        edit(edited)
        _reseal(ckpt, edited)
        with pytest.raises(CheckpointError, match=r"manifest\.json: " + message + r" — the manifest does "
                           r"not describe a checkpoint this code wrote \(damaged, or edited\); load an earlier"):
            export.export(root, tmp_path / "w.safetensors")


def test_latest_that_is_a_directory_at_load_and_at_save(tmp_path):
    """#38, #44: `latest` a directory: load says so (not 'no manifest'); save refuses before
    writing anything (no new ckpt-N, no latest.tmp)."""
    root, ckpt = _saved(tmp_path)
    (root / "latest").unlink()
    (root / "latest").mkdir()
    with pytest.raises(CheckpointError, match=r"'latest' is a directory, not the file naming the newest "
                                              r"checkpoint — load one of the ckpt-\* directories there "
                                              r"directly"):
        export.export(root, tmp_path / "w.safetensors")
    export.export(ckpt, tmp_path / "w.safetensors")  # the hint works
    (root / "latest").rmdir()  # deleted: the message names the checkpoints there
    with pytest.raises(CheckpointError, match=r"neither .*/latest nor .*/manifest\.json exists; it holds "
                                              r"ckpt-1: load one of them directly"):
        export.export(root, tmp_path / "w.safetensors")
    (root / "latest").mkdir()
    engine = _engine(tmp_path)
    train(engine, 0, 2)
    before = sorted(os.listdir(root))
    with pytest.raises(CheckpointError, match=r"latest is a directory, not the file naming the newest "
                                              r"checkpoint; nothing was written"):
        engine.save_checkpoint(root)
    assert sorted(os.listdir(root)) == before
    engine.close()


def test_latest_that_is_not_text(tmp_path):
    """#39: `latest` holding bytes that are not UTF-8: a CheckpointError on load, and a one-line
    error from `zerotier export` (#77)."""
    root, _ = _saved(tmp_path)
    (root / "latest").write_bytes(b"\xff\xfe\x00ckpt-1")
    engine = _engine(tmp_path)
    with pytest.raises(CheckpointError, match=r"'latest' holds bytes that are not UTF-8 text, not the name "
                                              r"of a checkpoint directory inside"):
        engine.load_checkpoint(root)
    engine.close()
    out = subprocess.run([sys.executable, "-m", "zerotier.cli", "export", str(root), "--to",
                          str(tmp_path / "w.safetensors")], capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"zerotier export: error: checkpoint root {root}: 'latest' holds bytes" in out.stderr


def test_checkpoint_reads_nothing_outside_its_directory(tmp_path):
    """#45: `latest` naming a path outside root, and a manifest (checksum fixed) naming a data
    file outside the checkpoint, are refused before anything is opened: the error cannot tell
    the outside file's length."""
    root, ckpt = _saved(tmp_path)
    import shutil
    shutil.copytree(ckpt, tmp_path / "outside" / "ckpt-1")
    for latest in (str(tmp_path / "outside" / "ckpt-1"), "../outside/ckpt-1", "..", "ckpt-1/../../outside/ckpt-1"):
        (root / "latest").write_text(latest + "\n")
        with pytest.raises(CheckpointError, match=r"'latest' holds '.*', not the name of a checkpoint "
                                                  r"directory inside"):
            checkpoint_read.resolve(root)
    (root / "latest").write_text("ckpt-1\n")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 1221)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in (str(secret), "../../secret.bin", "/etc/passwd"):
        manifest["ranks"][0]["file"] = name
        _reseal(ckpt, manifest)
        with pytest.raises(CheckpointError, match=r"ranks\[0\]\.file is '.*', not 'rank0\.bin'") as info:
            export.export(root, tmp_path / "w.safetensors")
        assert "1221" not in str(info.value)


def test_load_after_close_is_refused_naming_the_fix(tmp_path):
    """Issue 37 row 16: an internal IllegalTransition before; now what happened and what to do."""
    engine = _engine(tmp_path)
    train(engine, 0, 1)
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    with pytest.raises(ZerotierError, match=r"engine.load_checkpoint\(\) after engine.close\(\).*"
                                            r"zerotier.initialize\(model, config\) again"):
        engine.load_checkpoint(tmp_path / "ck")


def test_load_between_a_forward_and_its_backward_is_refused_as_torch_does(tmp_path):
    """Issue 37 row 16: the backward would have run on the loaded weights; torch refuses the order
    ('modified by an inplace operation'). Before the forward, after the backward, after a forward
    under no_grad or a zero_grad() that drops it: loads."""
    engine = _engine(tmp_path)
    train(engine, 0, 1)
    engine.save_checkpoint(tmp_path / "ck")
    x, y = micro_batches(1, 1)[0]
    loss = engine(x, y)
    with pytest.raises(ZerotierError, match=r"load_checkpoint\(\) between a forward and its backward"):
        engine.load_checkpoint(tmp_path / "ck")
    assert engine.global_steps == 1
    engine.backward(loss)                 # the refused load changed nothing: the window goes on
    engine.load_checkpoint(tmp_path / "ck")  # after the backward: loads (the window's gradients dropped)
    with torch.no_grad():
        engine(x, y)
    engine.load_checkpoint(tmp_path / "ck")
    engine(x, y)
    engine.zero_grad()
    engine.load_checkpoint(tmp_path / "ck")
    train(engine, 1, 1)
    assert engine.global_steps == 2
    engine.close()


SAVER_THAT_WAITS = """
import sys, zerotier
sys.path.insert(0, {tests!r})
from test_checkpoint import make_model, config, train, HOST
engine = zerotier.initialize(make_model(), config(HOST, {tmp!r}))
train(engine, 0, 1)
engine.save_checkpoint({root!r})
print("saved", flush=True)
sys.stdin.readline()  # holds the root until told (or killed)
"""


def test_a_second_run_saving_into_the_same_root_is_refused_naming_the_first(tmp_path):
    """Issue 37 row 10: two runs saving into one root replaced each other's ckpt-N and `latest`.
    The root is locked as the swap directory is ([Note: the checkpoint root lock]): another process,
    or another engine in this process, is refused at its first save with the owner named and nothing
    written; the lock goes with close() or the owner's death."""
    root = tmp_path / "ck"
    script = SAVER_THAT_WAITS.format(tests=os.path.dirname(__file__), tmp=str(tmp_path), root=str(root))
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "saved"
        before = {p.name: p.stat().st_mtime_ns for p in root.iterdir()}
        engine = _engine(tmp_path)
        train(engine, 0, 1)
        with pytest.raises(CheckpointError, match=rf"checkpoint root {root} is in use by pid {child.pid} on host "
                                                  rf"{socket.gethostname()}, run id [0-9a-f]+.*nothing was written"):
            engine.save_checkpoint(root)
        assert {p.name: p.stat().st_mtime_ns for p in root.iterdir()} == before
        engine.save_checkpoint(tmp_path / "elsewhere")  # another root: saves
    finally:
        child.kill()  # dies holding the lock: the kernel drops it
        child.wait(30)
    assert engine.save_checkpoint(root) == root / "ckpt-1"
    other = _engine(tmp_path)                          # another engine in this process
    with pytest.raises(CheckpointError, match=rf"in use by another engine in this process \(pid {os.getpid()}\), "
                                              rf"run id {engine.run_id}"):
        other.save_checkpoint(root)
    train(engine, 1, 1)
    engine.save_checkpoint(root)                       # the holder saves on
    engine.close()
    other.runtime.steps.global_steps = 7
    assert other.save_checkpoint(root) == root / "ckpt-7"  # free after close()
    assert (root / "latest").read_text().strip() == "ckpt-7"
    other.close()
