"""Bad configuration and bad input: one test per row of docs/errors.md, named after its row.

Each test checks the error type and the message's stable part (what the table quotes),
or, for inputs that must work (frozen and tied parameters), that they do.
"""
from __future__ import annotations

import errno
import json
import os
import re
import sys

import pytest
import torch

import zerotier
from zerotier.config import Config
from zerotier.errors import BudgetError, ConfigError, TierIOError, ZerotierError
from zerotier.models import TinyGPT, batches
from zerotier.optim import CPUAdamW

VOCAB, SEQ, BATCH = 64, 8, 2


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyGPT(vocab=VOCAB, dim=16, layers=1, heads=2, seq=SEQ, **kw)


def nvme_cfg(path, nvme="256MiB"):
    return {"offload": {"params": "host", "optimizer": "nvme"}, "tiers": {"nvme_path": str(path), "nvme": nvme}}


def tier_error(exc_info, code, pattern):
    """TierIOError is OSError(errno, message): str() prefixes "[Errno N] "; check errno and the message."""
    assert exc_info.value.errno in ((code,) if isinstance(code, int) else code), exc_info.value
    assert re.match(pattern, exc_info.value.strerror), exc_info.value.strerror


def train(engine, steps=2, seed=0):
    for x, y in batches(VOCAB, SEQ, BATCH, steps, seed=seed):
        engine.backward(engine(x, y))
        engine.step()


# ----------------------------------------------------------------------------- configuration

def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match=r"^unknown config key 'tierz'; did you mean 'tiers'\? valid keys: "):
        Config.from_dict({"tierz": {}})


def test_unknown_nested_key():
    with pytest.raises(ConfigError, match=r"^unknown config key 'tiers\.nvme_pth'; did you mean "
                                          r"'tiers\.nvme_path'\? valid keys: device, device_reserve, host, nvme, nvme_path$"):
        zerotier.initialize(tiny(), {"tiers": {"nvme_pth": "/tmp"}})


def test_unknown_key_in_config_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"optimizer": {"learning_rate": 0.1}}')
    with pytest.raises(ConfigError, match=rf"^{path}: unknown config key 'optimizer\.learning_rate';"):
        Config.load(path)


def test_bad_size_string():
    with pytest.raises(ConfigError, match=r"^tiers\.host: invalid size '12 parsecs': expected an int or a "
                                          r"string like '24GiB' / '1\.5TB' / 'auto'; units: "):
        Config.from_dict({"tiers": {"host": "12 parsecs"}})


def test_size_not_whole_bytes():
    with pytest.raises(ConfigError, match=r"^io\.block_size: size '1\.5B' is not a whole number of bytes"):
        Config.from_dict({"io": {"block_size": "1.5B"}})


def test_negative_budget():
    with pytest.raises(ConfigError, match=r"^tiers\.device: size must be >= 0, got -1$"):
        Config.from_dict({"tiers": {"device": -1}})
    with pytest.raises(ConfigError, match=r"^tiers\.nvme: size must be >= 0, got '-2GiB'$"):
        Config.from_dict({"tiers": {"nvme": "-2GiB"}})


def test_offload_nvme_without_nvme_path():
    with pytest.raises(ConfigError, match=r"^offload\.optimizer = 'nvme' needs tiers\.nvme_path: set it to a "
                                          r"directory on the NVMe drive$"):
        Config.from_dict({"offload": {"optimizer": "nvme"}})


def test_config_file_unknown_extension(tmp_path):
    path = tmp_path / "run.ini"
    path.write_text("[tiers]\n")
    with pytest.raises(ConfigError, match=rf"^{path}: unknown config file extension '\.ini'; use \.toml, \.json, "
                                          r"\.yaml or \.yml$"):
        zerotier.initialize(tiny(), str(path))


def test_yaml_without_pyyaml(tmp_path, monkeypatch):
    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  lr: 0.1\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    with pytest.raises(ConfigError, match=rf"^{path}: reading YAML needs PyYAML: pip install pyyaml "
                                          r"\(or use a \.toml or \.json file\)$"):
        Config.load(path)


@pytest.mark.parametrize("section,key", [("optimizer", "delayed_update"), ("optimizer", "subgroup_size"),
                                         ("io", "max_inflight_bytes")])
@pytest.mark.pins("design#config-tells-the-truth")
def test_unimplemented_keys_rejected_at_parse_time(section, key):
    # Keys nothing reads are not accepted: a user setting one learns at once that it does nothing.
    with pytest.raises(ConfigError, match=rf"^unknown config key '{section}\.{key}'; valid keys: "):
        zerotier.initialize(tiny(), {section: {key: 1}})


# ------------------------------------------------------------------------------ nvme_path

def test_nvme_path_missing(tmp_path):
    """A config mistake, said as one: ConfigError naming the key, the path and the fix, no raw
    `[Errno 2]` (issue 26 item 7)."""
    missing = tmp_path / "no" / "such"
    with pytest.raises(ConfigError, match=rf"^tiers\.nvme_path {missing} does not exist: create it "
                                          rf"\(mkdir -p {missing}\) or set tiers\.nvme_path to a directory on "
                                          r"the NVMe drive$"):
        zerotier.initialize(tiny(), nvme_cfg(missing))


def test_nvme_path_missing_with_auto_budget(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(ConfigError, match=rf"^tiers\.nvme_path {missing} does not exist: create it"):
        zerotier.initialize(tiny(), nvme_cfg(missing, nvme="auto"))


def test_nvme_path_under_a_regular_file(tmp_path):
    """Root ignores permission bits, but nothing can be created under a regular file."""
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(TierIOError) as ei:
        zerotier.initialize(tiny(), nvme_cfg(f / "swap"))
    tier_error(ei, errno.ENOTDIR, rf"nvme tier: cannot stat tiers\.nvme_path {f / 'swap'}: Not a directory; "
                                  r"fix tiers\.nvme_path$")
    with pytest.raises(TierIOError) as ei:
        zerotier.initialize(tiny(), nvme_cfg(f))
    tier_error(ei, errno.ENOTDIR, rf"nvme tier: tiers\.nvme_path {f} is not a directory; ")


def test_nvme_path_unwritable():
    """sysfs refuses mkdir to everyone, root included (root bypasses permission bits elsewhere)."""
    if not os.path.isdir("/sys/kernel"):
        pytest.skip("no /sys here")
    with pytest.raises(TierIOError) as ei:
        zerotier.initialize(tiny(), nvme_cfg("/sys/kernel"))
    tier_error(ei, (errno.EACCES, errno.EPERM, errno.EROFS), r"nvme tier: .*/sys/kernel.* not writable")


# ------------------------------------------------------------------------------ budgets

def test_budget_too_small():
    model = tiny()
    n = sum(p.numel() for p in set(model.parameters()))
    with pytest.raises(BudgetError, match=r"^the optimizer of [\d,]+ parameters does not fit within the tier "
                                          r"budgets; .*more device.*more host.*enable the nvme tier") as ei:
        zerotier.initialize(model, {"tiers": {"device": 9 * n, "host": "1KiB"}})
    assert type(ei.value).__name__ == "PlanDoesNotFit"


def test_budget_too_small_says_the_whole_shortfall():
    """Everything on host with a host budget too small for all of it: one message names what the
    whole plan needs, not only the first kind that misses (following it fits in one round)."""
    cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "host"}, "tiers": {"host": "100KiB"}}
    with pytest.raises(BudgetError, match=r"The whole plan, placed the cheapest way \(params on host, gradients on "
                                          r"host, optimizer on host\):\n.*\n.*\n  host +[\d.]+ KiB +100.00 KiB +[\d.]+ KiB\n"
                                          r"(.*\n)*Cheapest fixes, in order:\n  1. tiers.host = \"\d+ KiB\" "
                                          r"\([\d.]+ KiB more host\)") as ei:
        zerotier.initialize(tiny(), cfg)
    # issue 37 row 16: the advised size is one the config accepts as written ('7.01 MiB' was refused)
    cfg["tiers"]["host"] = re.search(r'1. tiers.host = "(\d+ KiB)"', str(ei.value)).group(1)
    with zerotier.initialize(tiny(), cfg) as engine:  # the stated need is enough
        assert engine.plan.placement["optimizer"].value == "host"


# ------------------------------------------------------------------------------ the model

def test_model_without_parameters():
    with pytest.raises(ConfigError, match=r"^the model has no trainable parameters \(all are frozen or there "
                                          r"are none\); there is nothing for zerotier to train$"):
        zerotier.initialize(torch.nn.ReLU(), {})


def test_model_all_parameters_frozen():
    with pytest.raises(ConfigError, match=r"^the model has no trainable parameters "):
        zerotier.initialize(tiny().requires_grad_(False), {})


def test_frozen_parameter_among_trainable_ones():
    model = tiny()
    model.pos.requires_grad_(False)
    pos, head = model.pos.detach().clone(), model.blocks[0].fc.weight.detach().clone()
    with zerotier.initialize(model, {"offload": {"params": "host"}}) as engine:
        train(engine, 3)
        weights = engine.parameters_fp32()
    assert "pos" not in weights
    assert torch.equal(model.pos, pos)                       # left alone
    assert not torch.equal(weights["blocks.0.fc.weight"], head)  # the rest trained


def test_tied_weight():
    model = tiny()
    assert model.head.weight is model.tok.weight
    before = model.tok.weight.detach().clone()
    with zerotier.initialize(model, {}) as engine:
        train(engine, 3)
        weights = engine.parameters_fp32()
        assert model.head.weight is model.tok.weight            # still tied
        assert torch.equal(model.head.weight, model.tok.weight)
        assert not torch.equal(model.tok.weight, before)        # and trained
        torch.testing.assert_close(model.tok.weight.detach(), weights["tok.weight"])


# ------------------------------------------------------------------------------ the training loop

@pytest.fixture
def engine():
    e = zerotier.initialize(tiny(), {})
    yield e
    e.close()


def _loss(engine, seed=0):
    x, y = next(batches(VOCAB, SEQ, BATCH, 1, seed=seed))
    return engine(x, y)


def test_step_before_backward(engine):
    with pytest.raises(ZerotierError, match=r"^engine\.step\(\) called before engine\.backward\(loss\): there "
                                            r"are no gradients to apply$"):
        engine.step()


def test_backward_again_after_an_early_step():
    """engine.backward() twice before step() accumulates like torch (tests/test_window.py), except
    where the window's update already started during the first (train.early_step)."""
    with zerotier.initialize(tiny(), {"train": {"overlap": "early"}}) as engine:
        engine.backward(_loss(engine, 0))
        with pytest.raises(ZerotierError, match=r"^engine\.backward\(\) again after a backward whose update "
                                                r"already started \(train\.overlap = 'early' applies the "
                                                r"window's update during its last backward\): call "
                                                r"engine\.step\(\) first, or set train\.overlap = 'auto'"):
            engine.backward(_loss(engine, 1))
        assert engine.step()  # the loop goes on normally
        engine.backward(_loss(engine, 2))
        assert engine.step() is True


def test_same_loss_backward_twice(engine):
    loss = _loss(engine)
    engine.backward(loss)
    with pytest.raises(ZerotierError, match=r"^engine\.backward\(loss\) twice with the same loss tensor: the "
                                            r"first backward freed its graph"):
        engine.backward(loss)
    assert engine.step()  # nothing was left half-done


def test_non_scalar_loss(engine):
    x, _ = next(batches(VOCAB, SEQ, BATCH, 1))
    logits = engine(x)
    with pytest.raises(ZerotierError, match=r"^engine\.backward\(loss\) needs the scalar loss tensor of this "
                                            r"micro-batch$"):
        engine.backward(logits)
    engine.backward(logits.float().square().mean())  # refused input left no state behind
    assert engine.step()


@pytest.mark.parametrize("code,reason,hint", [
    (errno.ENOSPC, "No space left on device", "free space on {dir} or lower tiers.nvme"),
    (errno.EIO, "Input/output error", "the drive reported an I/O error: check it (dmesg, smartctl)"),
])
def test_nvme_write_fails_during_training(tmp_path, code, reason, hint):
    with pytest.warns(RuntimeWarning, match=r"not put back into the model: engine\.step\(\) failed"), \
            zerotier.initialize(tiny(), nvme_cfg(tmp_path)) as engine:
        train(engine, 2)
        engine.store.engine.inject_fault(op="write", errno=code)
        x, y = next(batches(VOCAB, SEQ, BATCH, 1, seed=5))
        engine.backward(engine(x, y))
        with pytest.raises(TierIOError) as ei:
            engine.step()
        msg = ei.value.strerror
        assert ei.value.errno == code
        assert msg.startswith("nvme tier: write of shard '") and " at offset 0 of " in msg, msg
        assert str(engine.store.run_dir) in msg and f"failed: {reason}" in msg, msg
        assert hint.format(dir=tmp_path) in msg, msg


# ------------------------------------------------------------------------------ CPUAdamW

def test_cpu_adamw_amsgrad():
    with pytest.raises(ZerotierError, match=r"^CPUAdamW: amsgrad is not implemented by the CPU kernel; use "
                                            r"torch\.optim\.AdamW\(amsgrad=True\)$"):
        CPUAdamW([torch.nn.Parameter(torch.zeros(4))], amsgrad=True)


def test_cpu_adamw_non_contiguous_parameter():
    p = torch.nn.Parameter(torch.randn(6, 4).t())  # a transposed view: not contiguous
    assert not p.is_contiguous()
    before = p.detach().clone()
    p.grad = torch.ones_like(p)
    opt = CPUAdamW([p])
    with pytest.raises(ZerotierError, match=r"^master is not contiguous; the kernel updates memory in place and will "
                                            r"not silently update a temporary copy \(call \.contiguous\(\) on the "
                                            r"parameter itself\)$"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_plain_loss_backward_with_a_loss_scale():
    engine = zerotier.initialize(tiny(), {"precision": {"param_dtype": "fp16", "loss_scale": "dynamic"}})
    x, y = next(batches(VOCAB, SEQ, 2, 1))
    with pytest.raises(ZerotierError, match=r"^a plain loss.backward\(\) cannot be exact here \(the loss scale "
                                            r".*\): call engine.backward\(loss\) and engine.step\(\)"):
        engine(x, y).float().backward()
    engine.optimizer.step()  # nothing was accumulated: nothing to apply
    assert engine.global_steps == 0
    engine.backward(engine(x, y).float())  # the engine's own backward works afterwards
    engine.step()
    engine.close()


# ------------------------------------------------------------------------------ the table itself

def test_every_row_of_docs_errors_md_is_tested():
    """docs/errors.md names one test per row; each exists here, and every test here has a row."""
    from pathlib import Path

    table = (Path(__file__).parent.parent / "docs" / "errors.md").read_text()
    named = set()
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[2] in ("Test", "---"):
            continue
        # one test or several: `tests/x.py::test_a`, `test_b` (a bare name is in the file named before
        # it in the cell, or here)
        tests = re.findall(r"`(?:(tests/\w+\.py)::)?(test_\w+)(?:\[[\w-]+\])?`", cells[2])
        assert tests, f"docs/errors.md row without a test: {cells[2]}"
        owner = None
        for path, name in tests:
            owner = path or owner
            if owner is None:
                named.add(name)
                continue
            source = (Path(__file__).parent.parent / owner).read_text()
            assert f"def {name}(" in source, f"{owner}::{name} named in docs/errors.md does not exist"
    here = {name for name, obj in globals().items() if name.startswith("test_") and callable(obj)}
    assert named - here == set(), "rows naming a test that does not exist"
    assert here - named - {"test_every_row_of_docs_errors_md_is_tested"} == set(), "tests without a row"


# ------------------------------------------------------------ hostile-trial rows (issue 16)

def test_nvme_auto_on_a_full_or_unwritable_path_names_the_path():
    """Hostile #9: /proc has no free space (a full disk reads the same): the message says so
    and never asks to set tiers.nvme_path, which is set."""
    cfg = {"offload": {"optimizer": "nvme"}, "tiers": {"nvme_path": "/proc", "nvme": "auto"}}
    with pytest.raises(BudgetError) as ei:
        zerotier.initialize(tiny(), cfg)
    msg = str(ei.value)
    assert "set tiers.nvme_path" not in msg, msg
    assert re.search(r"tiers\.nvme = 'auto' found 0 B free in tiers\.nvme_path /proc: free space there or "
                     r"point tiers\.nvme_path at a writable drive with room", msg), msg


@pytest.mark.parametrize("where", ["missing-dir", "proc", "a-directory"])
def test_unwritable_trace_path_is_refused_at_initialize(tmp_path, where):
    """Hostile #13: refused at initialize, not after the whole run at close()."""
    path = {"missing-dir": str(tmp_path / "no" / "trace.json"), "proc": "/proc/trace.json",
            "a-directory": str(tmp_path)}[where]
    with pytest.raises(ConfigError, match=r"^profile\.trace_path .*(cannot create files in|is a directory)"):
        zerotier.initialize(tiny(), {"profile": {"enabled": True, "trace_path": path}})


def test_trace_write_failing_at_close_still_removes_the_run_dir(tmp_path, monkeypatch):
    """Hostile #13: a trace that cannot be written at close() (its directory removed mid-run)
    is reported, and close() still closes the NVMe store and removes its run directory."""
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    cfg = {**nvme_cfg(tmp_path), "profile": {"enabled": True, "trace_path": str(trace_dir / "t.json")}}
    engine = zerotier.initialize(tiny(), cfg)
    train(engine, 1)
    run_dir = engine.store.run_dir
    trace_dir.rmdir()
    with pytest.raises(ZerotierError, match="cannot write the profiler trace"):
        engine.close()
    assert not run_dir.exists()


# ------------------------------------------- parsers (issue 16 item 4; hostile #11, #77)

@pytest.mark.parametrize("name,raw,why", [
    ("run.toml", b"\xff\xfe[zero]\nstage = 1\n", r"not valid TOML: not UTF-8 text \(byte 0xff at offset 0\); save it "
                                                  r"as UTF-8"),
    ("run.json", b"[" * 100_000, r"not valid JSON: nested too deeply"),
    ("run.yaml", b"zero: {stage: 2001-02-30}\n", r"not valid YAML: day is out of range for month"),
])
def test_config_file_that_does_not_parse(tmp_path, name, raw, why):
    """Hostile #11: whatever the parser refuses (bytes that are not UTF-8, a nesting that
    exhausts the parser's recursion, a date that does not exist) is a ConfigError naming the file."""
    path = tmp_path / name
    path.write_bytes(raw)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: {why}"):
        Config.load(path)


def test_size_out_of_range():
    """An exponent that would take minutes to expand, or a size past int64, is refused at once."""
    with pytest.raises(ConfigError, match=r"^tiers\.nvme: size '1e999999999' is out of range \(0 to 8 EiB\)$"):
        Config.from_dict({"tiers": {"nvme": "1e999999999", "nvme_path": "/tmp"}})
    with pytest.raises(ConfigError, match=r"^tiers\.host: size <an int of 3322 bits> is out of range \(0 to 8 EiB\)$"):
        Config.from_dict({"tiers": {"host": 10**1000}})


def _cli(capsys, *argv):
    """`zerotier ARGV` in this process: (exit status, stderr)."""
    from zerotier import cli

    status = cli.main(list(argv))
    return status, capsys.readouterr().err


def test_cli_export_to_a_missing_directory(tmp_path, capsys):
    """Hostile #77: one line, no FileNotFoundError traceback, no .tmp left."""
    with zerotier.initialize(tiny(), {}) as engine:
        train(engine, 1)
        engine.save_checkpoint(tmp_path / "ck")
    out = tmp_path / "missing" / "dir" / "w.safetensors"
    status, err = _cli(capsys, "export", str(tmp_path / "ck"), "--to", str(out))
    assert status == 1 and err == (f"zerotier export: error: export --to {out}: the directory {out.parent} does "
                                   f"not exist; create it first\n")


def test_cli_bench_io_path_not_usable(capsys):
    """Hostile #77: a missing directory, and one where no file can be made (/proc)."""
    status, err = _cli(capsys, "bench", "io", "--nvme-path", "/nonexistent", "--quick", "--no-save")
    assert status == 1 and err == ("zerotier bench: error: --path/--nvme-path /nonexistent: not an existing "
                                   "directory; give a directory on the drive to measure\n")
    status, err = _cli(capsys, "bench", "io", "--nvme-path", "/proc", "--quick", "--no-save")
    assert status == 1 and re.fullmatch(r"zerotier bench: error: --path/--nvme-path /proc: cannot create files "
                                        r"there \(.*\); give a writable directory on the drive to measure\n", err), err


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_cli_demo_steps_below_one(capsys, steps):
    """Hostile #77: refused before the demo starts (it used to end in a TypeError)."""
    status, err = _cli(capsys, "demo", "--steps", steps)
    assert status == 1 and err == f"zerotier demo: error: --steps: must be >= 1, got {steps}\n"


def test_trace_damaged_or_edited(tmp_path):
    """`zerotier profile` on a trace whose fields were edited: a ZerotierError naming the field."""
    from zerotier.config import ProfileConfig
    from zerotier.profiler import Profiler, load_trace

    prof = Profiler(ProfileConfig(enabled=True, record_function=False), residency=None, peak_rates={})
    prof.record("u00000.param", "param", "host", "device", 4096, "prefetch", prof.t0_ns, prof.t0_ns + 1000)
    trace = prof.trace()
    prof.close()
    event = next(e for e in trace["traceEvents"] if e.get("cat") == "transfer")
    event["args"]["bytes"] = "4096"
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    with pytest.raises(ZerotierError, match=rf"^{re.escape(str(path))}: traceEvents\[\d+\]\.args\.bytes is '4096', "
                                            r"not a count — not a trace zerotier wrote \(damaged or edited\); "
                                            r"profile again to get a new one$"):
        load_trace(str(path))


def test_trace_gzip_bomb_is_refused(tmp_path, monkeypatch):
    """`zerotier profile` of a .json.gz that expands 1000x: refused at the ratio limit, not read
    into memory whole (the floor is lowered here so the test's bomb is small)."""
    import gzip

    from zerotier.profiler import load_trace, trace_file
    monkeypatch.setattr(trace_file, "_MIN_GZIP_LIMIT", 1 << 20)
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wb") as f:
        f.write(b'{"traceEvents": [], "zerotier": {"pad": "')
        for _ in range(16):
            f.write(b" " * (1 << 20))
        f.write(b'"}}')
    assert path.stat().st_size * 100 < 16 << 20
    with pytest.raises(ZerotierError, match=rf"^{re.escape(str(path))}: the gzip stream expands to more than 1 MiB "
                                            r"\(100x its \d+ bytes\): not a trace zerotier wrote"):
        load_trace(str(path))


def test_pretrained_index_naming_a_shard_outside_the_directory(tmp_path):
    """from_pretrained reads only files inside the directory: an index naming '../x' or an
    absolute path, or naming no file (null; found by tests/test_fuzz.py), is a ConfigError."""
    transformers = pytest.importorskip("transformers", reason="pip install transformers (part of .[test])")
    path = tmp_path / "hf"
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=VOCAB, n_positions=8).save_pretrained(path)
    for shard in ("../outside.safetensors", "/etc/passwd"):
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": shard}}))
        with pytest.raises(ConfigError, match=rf"model\.safetensors\.index\.json lists the shard '{shard}', which is "
                                              r"not a file name in .*hf$"):
            zerotier.from_pretrained(path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": None}}))
    with pytest.raises(ConfigError, match=r"model\.safetensors\.index\.json: not a safetensors index \(a JSON object "
                                          r"with a 'weight_map' of tensor name -> shard file\): a shard file name is "
                                          r"not a string$"):
        zerotier.from_pretrained(path)
