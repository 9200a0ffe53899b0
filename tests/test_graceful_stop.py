"""Graceful stop ([Note: graceful stop] in zerotier/engine/stop.py): SIGTERM / SIGINT / request_stop()
end training at a step boundary with an emergency checkpoint that resumes bitwise, nothing
left in nvme_path, and every rank stopping after the same step."""
import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import zerotier
from zerotier.engine import stop
from zerotier.dist import spawn
from zerotier.models import TinyGPT, batches

VOCAB, SEQ, BATCH, ACCUM, STEPS = 64, 16, 4, 2, 30


@pytest.fixture(autouse=True)
def _no_engine_left_open_by_earlier_tests():
    """These tests send signals to this process: an engine an earlier test left open would take the
    stop request (or make this test's first signal a second one, which kills the process). Fail
    loudly instead, naming the strays."""
    gc.collect()
    strays = [e for e in list(stop._engines) if not e.closed]
    if strays:
        pytest.fail(f"{len(strays)} engine(s) left open by earlier tests are registered for signals: {strays}")
    yield


def test_an_engine_dropped_without_close_leaves_no_stop_behind(tmp_path):
    """A signal reached an engine that was then dropped without close() and collected (it never
    unregisters): the next engine's first signal is a graceful stop, not an 'asked twice' kill."""
    engine = zerotier.initialize(make_model(), config(tmp_path))
    os.kill(os.getpid(), signal.SIGINT)        # recorded on the engine: a stop is pending
    assert engine.stop_requested
    stop._engines.discard(engine)              # what collecting an unclosed engine does to the WeakSet
    fresh = zerotier.initialize(make_model(), config(tmp_path))
    try:
        os.kill(os.getpid(), signal.SIGINT)    # a first signal: recorded, not KeyboardInterrupt
        assert fresh.stop_requested
    finally:
        engine.close()
        fresh.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def make_model():
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=32, layers=2, heads=2, seq=SEQ)


def config(nvme_dir, ckpt=None, **train):
    return {"offload": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
            "tiers": {"nvme_path": str(nvme_dir)}, "optimizer": {"lr": 3e-3, "weight_decay": 0.01},
            "zero": {"persistence_threshold": 0},
            "train": {"grad_accum_steps": ACCUM, "max_grad_norm": 1.0, "checkpoint_on_signal": ckpt, **train}}


def micro_batches(step, rank=0, world=1):
    """The micro-batches of optimizer step `step`, this rank's part."""
    data = list(batches(VOCAB, SEQ, BATCH, (step + 1) * ACCUM, seed=3))[step * ACCUM:]
    half = BATCH // world
    return [(x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]) for x, y in data]


def train(engine, until, rank=0, world=1):
    while engine.global_steps < until:
        for x, y in micro_batches(engine.global_steps, rank, world):
            engine.backward(engine(x, y))
            engine.step()


CHILD = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from test_graceful_stop import config, make_model, micro_batches, STEPS
    import zerotier
    engine = zerotier.initialize(make_model(), config({nvme!r}, {ckpt!r}))
    while engine.global_steps < STEPS:
        for x, y in micro_batches(engine.global_steps):
            engine.backward(engine(x, y))
            engine.step()
        print("step", engine.global_steps, flush=True)
    engine.close()
    print("finished", flush=True)
""")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the child's, so the runs compare bitwise
    try:
        with zerotier.initialize(make_model(), config(tmp_path_factory.mktemp("ref"))) as engine:
            train(engine, STEPS)
            return engine.parameters_fp32()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigterm_at_a_random_point_checkpoints_cleans_up_and_resumes_bitwise(uninterrupted, tmp_path, seed):
    rng = random.Random(seed)
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    script = CHILD.format(tests=os.path.dirname(__file__), nvme=str(nvme), ckpt=str(ckpt))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    at = rng.randint(1, STEPS - 12)
    for line in child.stdout:
        if line.split() == ["step", str(at)]:
            break
    time.sleep(rng.uniform(0, 0.08))  # anywhere in a step: forward, backward, the update, its I/O
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGTERM, (out, err)
    assert "SIGTERM received: stopping after the current step" in err, err
    assert "training stopped after step" in err and "resume with engine.load_checkpoint" in err, err
    assert "finished" not in out
    assert os.listdir(nvme) == [], "the run directory must be removed"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with zerotier.initialize(make_model(), config(nvme)) as engine:
            engine.load_checkpoint(ckpt)
            assert at <= engine.global_steps < STEPS  # (the child may be steps ahead of the lines read)
            train(engine, STEPS)
            got = engine.parameters_fp32()
    finally:
        torch.set_num_threads(threads)
    for name in uninterrupted:
        assert torch.equal(got[name], uninterrupted[name]), name


def test_request_stop_finishes_the_window_then_checkpoints_and_closes(tmp_path):
    engine = zerotier.initialize(make_model(), config(tmp_path, str(tmp_path / "ckpt")))
    train(engine, 1)
    run_dir = engine.store.run_dir
    x, y = micro_batches(1)[0]
    engine.backward(engine(x, y))
    engine.request_stop()                  # mid-window: the window is finished first
    assert engine.step() is False
    x, y = micro_batches(1)[1]
    engine.backward(engine(x, y))
    with pytest.raises(zerotier.TrainingStopped) as info:
        engine.step()
    assert info.value.code == 0 and info.value.checkpoint == tmp_path / "ckpt" / "ckpt-2"
    assert "training stopped after step 2 (engine.request_stop())" in str(info.value)
    assert engine.closed and not run_dir.exists()
    with zerotier.initialize(make_model(), config(tmp_path)) as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert resumed.global_steps == 2


def test_stop_between_steps_happens_before_the_next_window(tmp_path):
    """One rank: a request that arrives between steps (the loop loading data) stops at the next
    forward, before a new window begins; no checkpoint configured: none written."""
    engine = zerotier.initialize(make_model(), config(tmp_path))
    train(engine, 1)
    engine.request_stop()
    x, y = micro_batches(1)[0]
    with pytest.raises(zerotier.TrainingStopped, match="after step 1 .*no checkpoint written"):
        engine(x, y)
    assert engine.closed


def test_second_sigint_interrupts_at_once(tmp_path):
    engine = zerotier.initialize(make_model(), config(tmp_path))
    try:
        assert signal.getsignal(signal.SIGINT) is stop._handle
        os.kill(os.getpid(), signal.SIGINT)   # the first asks for a graceful stop
        time.sleep(0.05)
        assert engine.stop_requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        engine.close()
    assert engine not in stop._engines
    if not stop._engines:  # (engines other tests left open keep the handlers installed)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored at the last close


def test_a_handler_the_user_installed_is_left_alone(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with zerotier.initialize(make_model(), config(tmp_path)) as engine:
            assert signal.getsignal(signal.SIGINT) is stop._handle  # per signal: SIGINT was the default
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert seen == [signal.SIGTERM] and not engine.stop_requested
        with zerotier.initialize(make_model(), config(tmp_path, handle_signals=False)) as engine:
            assert engine not in stop._engines
    finally:
        signal.signal(signal.SIGTERM, previous)


def _two_ranks(rank, world, nvme, ckpt):
    torch.set_num_threads(1)
    engine = zerotier.initialize(make_model(), config(nvme, ckpt))
    try:
        while True:
            if rank == 1 and engine.global_steps == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # only this rank is signalled
            for x, y in micro_batches(engine.global_steps, rank, world):
                engine.backward(engine(x, y))
                engine.step()
    except zerotier.TrainingStopped as stopped:
        return engine.global_steps, stopped.code, str(stopped.checkpoint), str(stopped)


def test_one_ranks_sigterm_stops_every_rank_after_the_same_step(tmp_path):
    results = spawn(_two_ranks, 2, str(tmp_path), str(tmp_path / "ckpt"), timeout_s=300)
    (steps0, code0, ckpt0, msg0), (steps1, code1, ckpt1, msg1) = results
    assert steps0 == steps1 and 4 <= steps0 <= 5
    assert code0 == code1 == 128 + signal.SIGTERM and ckpt0 == ckpt1
    assert "SIGTERM on another rank" in msg0 and "(SIGTERM)" in msg1
    assert [p for p in os.listdir(tmp_path) if p.startswith("zerotier-")] == []
    with zerotier.initialize(make_model(), config(tmp_path)) as engine:  # loads into one rank
        engine.load_checkpoint(tmp_path / "ckpt")
        assert engine.global_steps == steps0


def test_sighup_stops_like_sigterm_and_removes_the_run_directory(tmp_path):
    """Issue 21: a closed terminal (SIGHUP) killed the run by default and left its NVMe run directory.
    It is a graceful stop as SIGTERM is: the step finishes, close() removes the run directory."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    script = CHILD.format(tests=os.path.dirname(__file__), nvme=str(nvme), ckpt=None)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    for line in child.stdout:
        if line.split() == ["step", "2"]:
            break
    assert os.listdir(nvme), "the run directory exists while training"
    child.send_signal(signal.SIGHUP)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGHUP, (out, err)
    assert "SIGHUP received: stopping after the current step" in err, err
    assert "training stopped after step" in err and "finished" not in out
    assert os.listdir(nvme) == [], "the run directory must be removed"


class DataPosition:
    """A data position counter, advanced when a batch is taken (as a stateful data loader is)."""

    def __init__(self):
        self.taken = 0

    def state_dict(self):
        return {"taken": self.taken}

    def load_state_dict(self, state):
        self.taken = state["taken"]


def warmup_then_decay(step):
    return min(1.0, (step + 1) / 4) * 0.8 ** max(0, step - 3)


def _scheduled(nvme, ckpt=None):
    """An engine with a LambdaLR the engine steps and a registered data position (issue 37 row 3)."""
    engine = zerotier.initialize(make_model(), config(nvme, ckpt))
    engine.set_lr_scheduler(torch.optim.lr_scheduler.LambdaLR(engine.optimizer, warmup_then_decay))
    position = DataPosition()
    engine.register_for_checkpointing(position)
    return engine, position


def _train_scheduled(engine, position, until, signal_at=None):
    """Train to step `until`, the data chosen by the position; returns {step: the lr its update used}."""
    data = [b for step in range(until) for b in micro_batches(step)]
    lrs = {}
    while engine.global_steps < until:
        if engine.global_steps == signal_at and not engine.stop_requested:
            os.kill(os.getpid(), signal.SIGTERM)  # preempted between steps: the stop comes at the end of the next
        x, y = data[position.taken]
        position.taken += 1
        lr = engine.optimizer.param_groups[0]["lr"]
        engine.backward(engine(x, y))
        if engine.step():
            lrs[engine.global_steps] = lr
    return lrs


def test_signal_checkpoint_carries_the_lr_scheduler_and_registered_objects(tmp_path):
    """Issue 37 row 3: the checkpoint train.checkpoint_on_signal writes forgot the lr scheduler (the
    resumed schedule restarted: 3.78e-4 instead of 5.78e-4 at step 8) and any client state. A scheduler
    handed to the engine (set_lr_scheduler) and a registered data position are carried by it: the
    resumed run's lrs and weights are bitwise the uninterrupted run's."""
    steps, at = 10, 5
    engine, position = _scheduled(tmp_path)
    expected_lrs = _train_scheduled(engine, position, steps)
    expected = engine.parameters_fp32()
    engine.close()
    assert len(set(expected_lrs.values())) > 5  # the schedule moves

    engine, position = _scheduled(tmp_path, str(tmp_path / "ckpt"))
    with pytest.raises(zerotier.TrainingStopped) as stopped:
        _train_scheduled(engine, position, steps, signal_at=at)
    resumed, position = _scheduled(tmp_path)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert position.taken == resumed.global_steps * ACCUM  # no batch taken but not trained
    assert resumed.lr_scheduler.last_epoch == resumed.global_steps
    assert resumed.global_steps == at + 1 and stopped.value.checkpoint == tmp_path / "ckpt" / f"ckpt-{at + 1}"
    lrs = _train_scheduled(resumed, position, steps)
    assert lrs == {s: expected_lrs[s] for s in range(at + 2, steps + 1)}
    got = resumed.parameters_fp32()
    resumed.close()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_what_a_checkpoint_carries_is_refused_where_it_would_resume_wrongly(tmp_path):
    """[Note: what a checkpoint carries]: a scheduler the loop steps cannot be registered (a signal
    checkpoint would hold it a step behind); registered objects must match at load; the engine's
    scheduler stepped by the loop as well is refused."""
    engine, position = _scheduled(tmp_path)
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, warmup_then_decay)
    with pytest.raises(zerotier.ZerotierError, match="one step behind.*engine.set_lr_scheduler"):
        engine.register_for_checkpointing(sched)
    with pytest.raises(zerotier.ZerotierError, match="no state_dict"):
        engine.register_for_checkpointing(object())
    _train_scheduled(engine, position, 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.lr_scheduler.step()                  # the loop steps it as well: refused at the next update
    x, y = micro_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    x, y = micro_batches(1)[1]
    engine.backward(engine(x, y))
    with pytest.raises(zerotier.ZerotierError, match="stepped outside the engine"):
        engine.step()
    engine.close()
    other = zerotier.initialize(make_model(), config(tmp_path))
    other.register_for_checkpointing(DataPosition(), DataPosition())
    dropped = pytest.warns(RuntimeWarning, match="carries lr scheduler state, but no lr_scheduler= was given")
    with dropped, pytest.raises(zerotier.ZerotierError, match=r"carries registered objects \['DataPosition'\] but "
                                                              r"this engine has \['DataPosition', 'DataPosition'\]"):
        other.load_checkpoint(tmp_path / "ckpt")
    other.close()
    plain = zerotier.initialize(make_model(), config(tmp_path))
    dropped = pytest.warns(RuntimeWarning, match="carries lr scheduler state, but no lr_scheduler= was given")
    with dropped, pytest.warns(UserWarning, match="none is registered with this engine"):
        plain.load_checkpoint(tmp_path / "ckpt")
    plain.close()
