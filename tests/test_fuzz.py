"""Fuzzing every parser of user files (issue 16 item 4): any input either loads or raises a
ZerotierError with a message, never another exception type, a hang or a crash.

Targets: the config loader (dicts; .toml / .json / .yaml files), a checkpoint's `latest`,
manifest, data file and .pt parts (read by `zerotier export` and `load_checkpoint`), the
trace read by `zerotier profile`, and the safetensors files `zerotier.from_pretrained`
reads. Inputs are random, and mutations of real files: bit flips, truncations, random
bytes, and random edits of the parsed JSON / torch data written back with every checksum
fixed (so the checks behind the checksums are fuzzed too, not only the checksums).

hypothesis (property-based, shrinking): each test runs a few dozen examples in CI (the file
takes ~30 s on the 2-core dev VM); ZEROTIER_FUZZ_EXAMPLES=N runs N per test, for a long run:
    ZEROTIER_FUZZ_EXAMPLES=5000 python -m pytest tests/test_fuzz.py --hypothesis-show-statistics
"""
from __future__ import annotations

import copy
import gzip
import io
import json
import os
import tempfile
import warnings
from pathlib import Path

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zerotier
from zerotier import checkpoint_read, export
from zerotier.config import Config
from zerotier.errors import ZerotierError
from zerotier.models import TinyGPT, batches
from zerotier.profiler import Profiler, load_trace, summarize
from zerotier.config import ProfileConfig

LONG_RUN = int(os.environ.get("ZEROTIER_FUZZ_EXAMPLES", "0"))


def fuzz(examples: int):
    """hypothesis settings: `examples` in CI, $ZEROTIER_FUZZ_EXAMPLES in a long run. No deadline
    (a loaded 2-core machine); no example database (nothing written into the checkout: a
    failure prints its input and a @reproduce_failure blob)."""
    return settings(max_examples=LONG_RUN or examples, deadline=None, database=None, print_blob=True)


def loads_or_refuses(fn, *args, **kwargs):
    """fn(...)'s result, or the ZerotierError it raised (which must carry a message). Any other
    exception propagates: that is a finding."""
    try:
        return fn(*args, **kwargs)
    except ZerotierError as exc:
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        return exc


# --------------------------------------------------------------------------- shared strategies

scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats() | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _paths(node, prefix=()):
    """Every path (tuple of keys / indices) into a JSON-like tree, the root included."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@st.composite
def edited(draw, tree, values=json_values):
    """`tree` (a deep copy) with one random edit: a node replaced, deleted, a list item
    duplicated, or a number nudged by a little (an offset or a range off by one)."""
    tree = copy.deepcopy(tree)
    path = draw(st.sampled_from(list(_paths(tree))))
    if not path:
        return draw(values)
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    action = draw(st.sampled_from(["replace", "replace", "delete", "duplicate", "nudge"]))
    if action == "nudge" and type(parent[path[-1]]) is int:
        parent[path[-1]] += draw(st.integers(-3, 3))
    elif action in ("replace", "nudge"):
        parent[path[-1]] = draw(values)
    elif action == "delete":
        del parent[path[-1]]
    elif isinstance(parent, list):
        parent.insert(path[-1], copy.deepcopy(parent[path[-1]]))
    else:
        parent[path[-1] + "_"] = copy.deepcopy(parent[path[-1]])
    return tree


@st.composite
def damaged(draw, data: bytes):
    """`data` bit-flipped, truncated, extended or replaced by random bytes."""
    action = draw(st.sampled_from(["flip", "flip", "truncate", "extend", "random"]))
    if action == "flip" and data:
        bit = draw(st.integers(0, len(data) * 8 - 1))
        out = bytearray(data)
        out[bit // 8] ^= 1 << (bit % 8)
        return bytes(out)
    if action == "truncate":
        return data[:draw(st.integers(0, max(0, len(data) - 1)))]
    if action == "extend":
        return data + draw(st.binary(min_size=1, max_size=64))
    return draw(st.binary(max_size=256))


# --------------------------------------------------------------------------- configuration

SECTION_KEYS = {name: list(keys) for name, keys in Config().to_dict().items()}
sizes = st.sampled_from(["24GiB", "1.5TB", "4k", "0", "auto", "-2GiB", "1e999999999", "1e-99999999", "9e18",
                         "12 parsecs", "0x10", "1.5B", "nan", "inf", " 7 KiB "])
config_values = json_values | sizes | st.integers(min_value=-10**400, max_value=10**400)


@st.composite
def config_dicts(draw):
    """{section: {key: value}} with real and made-up names, any values."""
    out = {}
    for section in draw(st.lists(st.sampled_from(list(SECTION_KEYS)) | st.text(max_size=8), max_size=4)):
        if draw(st.booleans()):
            keys = draw(st.lists(st.sampled_from(SECTION_KEYS.get(section) or ["x"]) | st.text(max_size=8),
                                 max_size=4))
            out[section] = {k: draw(config_values) for k in keys}
        else:
            out[section] = draw(config_values)
    return out


@fuzz(200)
@given(config_dicts())
def test_fuzz_config_dicts(data):
    loads_or_refuses(Config.from_dict, data)


def _toml_value(value) -> str:
    if isinstance(value, (bool, int, float, str)):
        return json.dumps(value).replace("NaN", "nan").replace("Infinity", "inf")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in (value or {}).items()) + "}"


def _as_text(suffix: str, data: dict) -> bytes:
    if suffix == ".json":
        return json.dumps(data).encode()
    if suffix == ".toml":
        lines = []
        for section, value in data.items():
            lines.append(f"[{json.dumps(str(section))}]")
            for key, v in (value.items() if isinstance(value, dict) else [("value", value)]):
                lines.append(f"{json.dumps(str(key))} = {_toml_value(v)}")
        return "\n".join(lines).encode()
    import yaml
    return yaml.safe_dump(data, allow_unicode=True).encode()


yaml_snippets = st.sampled_from([
    "a: &a [x, x, x, x]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\noptimizer: {lr: *c}\n",  # an alias bomb
    "optimizer: {lr: " + "1" * 5000 + "}\n", "zero: {stage: 2001-02-30}\n", "x: !!binary 'abc'\n",
    "[" * 5000, "? [a, b]\n: 1\n", "tiers: !!set {a, b}\n", "io: {block_size: !!float .nan}\n",
    "optimizer: {betas: [0.9, 0.999, 0.5]}\n", "\xff\xfe", "%YAML 9.9\n---\n",
])


@fuzz(100)
@given(suffix=st.sampled_from([".toml", ".json", ".yaml"]), data=st.data())
def test_fuzz_config_files(suffix, data):
    """Random bytes, and config text with random values then damaged, as .toml/.json/.yaml."""
    source = data.draw(st.sampled_from(["random", "text", "damaged text"] + (["snippet"] if suffix == ".yaml" else [])))
    if source == "random":
        raw = data.draw(st.binary(max_size=300))
    elif source == "snippet":
        raw = data.draw(yaml_snippets).encode("utf-8", "surrogateescape")
    else:
        raw = _as_text(suffix, data.draw(config_dicts()))
        if source == "damaged text":
            raw = data.draw(damaged(raw))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"run{suffix}"
        path.write_bytes(raw)
        loads_or_refuses(Config.load, path)


# --------------------------------------------------------------------------- checkpoints

def _model():
    torch.manual_seed(0)
    return TinyGPT(vocab=32, dim=8, layers=2, heads=2, seq=4)


CKPT_CONFIG = {"train": {"wrap": ["Block"]}}  # several units: ranges and records per unit


class Files(dict):
    """A checkpoint's files by name -> bytes; shown in brief when hypothesis prints a failing case."""

    def __repr__(self) -> str:
        return f"<files {', '.join(self)}>"


class Blob(bytes):
    def __repr__(self) -> str:
        return f"<{len(self)} bytes>"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Files:
    """The files of a real checkpoint of a few units."""
    root = tmp_path_factory.mktemp("fuzz-ckpt") / "ck"
    with zerotier.initialize(_model(), CKPT_CONFIG) as engine:
        for x, y in batches(32, 4, 2, 1):
            engine.backward(engine(x, y))
            engine.step()
        ckpt = engine.save_checkpoint(root)
    return Files((p.name, p.read_bytes()) for p in ckpt.iterdir())


def _write_checkpoint(tmp: str, files: dict[str, bytes], latest: bytes = b"ckpt-1\n") -> Path:
    root = Path(tmp) / "ck"
    (root / "ckpt-1").mkdir(parents=True)
    for name, data in files.items():
        (root / "ckpt-1" / name).write_bytes(data)
    (root / "latest").write_bytes(latest)
    return root


def _sealed(manifest) -> bytes:
    """The manifest written back with its own checksum fixed ([Note: manifest checksum])."""
    if isinstance(manifest, dict):
        manifest = {k: v for k, v in manifest.items() if k != "crc32c"}
        manifest["crc32c"] = checkpoint_read.manifest_crc(manifest)
    return json.dumps(manifest).encode()


def _export(root: Path):
    return loads_or_refuses(export.export, root, root.parent / "out.safetensors")


def _load(root: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # close() after a refused load says it is partial
        with zerotier.initialize(_model(), CKPT_CONFIG) as engine:
            return loads_or_refuses(engine.load_checkpoint, root)


@fuzz(60)
@given(latest=st.binary(max_size=40) | st.sampled_from([b"/etc", b"../ck/ckpt-1", b"ckpt-1/../../x", b".",
                                                        b"ckpt-1\x00", b"\xff\xfe", b"ckpt-1\n\n", b" ckpt-1 "]))
def test_fuzz_latest(saved, latest):
    """Whatever `latest` holds, the checkpoint found is inside the root, or none is."""
    files = saved
    with tempfile.TemporaryDirectory() as tmp:
        root = _write_checkpoint(tmp, files, latest)
        found = loads_or_refuses(checkpoint_read.resolve, root)
        if isinstance(found, Path):
            assert found.parent == root


@fuzz(100)
@given(data=st.data())
def test_fuzz_manifest_bytes(saved, data):
    """A damaged manifest (its checksum not fixed): refused, or it says exactly what it said."""
    files = saved
    raw = data.draw(damaged(files["manifest.json"]))
    with tempfile.TemporaryDirectory() as tmp:
        root = _write_checkpoint(tmp, {**files, "manifest.json": raw})
        got = loads_or_refuses(checkpoint_read.read_manifest, root / "ckpt-1")
        if isinstance(got, dict):
            original = json.loads(files["manifest.json"])
            assert {k: got.get(k) for k in original if k != "crc32c"} == \
                   {k: v for k, v in original.items() if k != "crc32c"}
            assert not isinstance(_export(root), ZerotierError)


@fuzz(150)
@given(data=st.data())
def test_fuzz_manifest_edits(saved, data):
    """A manifest with any one edit, its checksum fixed: export (which reads every record)
    exports or refuses."""
    files = saved
    manifest = data.draw(edited(json.loads(files["manifest.json"])))
    with tempfile.TemporaryDirectory() as tmp:
        root = _write_checkpoint(tmp, {**files, "manifest.json": _sealed(manifest)})
        _export(root)


@fuzz(25)
@given(data=st.data())
def test_fuzz_manifest_edits_on_load(saved, data):
    """The same into a live engine's load_checkpoint (fingerprint, unit steps, RNG, state)."""
    files = saved
    manifest = data.draw(edited(json.loads(files["manifest.json"])))
    with tempfile.TemporaryDirectory() as tmp:
        _load(_write_checkpoint(tmp, {**files, "manifest.json": _sealed(manifest)}))


@fuzz(50)
@given(name=st.sampled_from(["rank0.bin", "rank0.pt", "state.pt"]), data=st.data())
def test_fuzz_data_files(saved, name, data):
    """A damaged data file or .pt part: every record and part is checksummed, so
    load_checkpoint (which reads them all) refuses it, unless no record's bytes changed
    (damage in the padding between aligned records, or past the last). Export (masters and
    state.pt only) exports or refuses."""
    files = saved
    raw = data.draw(damaged(files[name]))
    with tempfile.TemporaryDirectory() as tmp:
        root = _write_checkpoint(tmp, {**files, name: raw})
        _export(root)
        got = _load(root)
        if not isinstance(got, ZerotierError):
            records = json.loads(files["manifest.json"])["ranks"][0]["records"] if name == "rank0.bin" else \
                [{"offset": 0, "nbytes": max(len(raw), len(files[name]))}]
            for rec in records:
                span = slice(rec["offset"], rec["offset"] + rec["nbytes"])
                assert raw[span] == files[name][span], f"{name}: a damaged record was loaded"


tensors = st.builds(lambda shape, dtype: torch.zeros(shape, dtype=dtype),
                    st.lists(st.integers(0, 3), max_size=3),
                    st.sampled_from([torch.float32, torch.int64, torch.uint8, torch.complex64, torch.bool]))
pt_values = st.recursive(scalars | tensors, lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                         | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


@fuzz(40)
@given(name=st.sampled_from(["state.pt", "rank0.pt"]), data=st.data())
def test_fuzz_pt_parts_sealed(saved, name, data):
    """state.pt / rank0.pt holding other data (tensors, numbers, containers), their crc32c and
    the manifest's fixed: export and load_checkpoint load or refuse, never fail half-way
    with a KeyError or a torch error."""
    files = saved
    obj = torch.load(io.BytesIO(files[name]), weights_only=True)
    obj = data.draw(edited(obj, values=pt_values))
    buf = io.BytesIO()
    torch.save(obj, buf)
    raw = buf.getvalue()
    manifest = json.loads(files["manifest.json"])
    meta = manifest["state"] if name == "state.pt" else manifest["ranks"][0]["rng"]
    meta.update(nbytes=len(raw), crc32c=crc32c.crc32c(raw))
    with tempfile.TemporaryDirectory() as tmp:
        root = _write_checkpoint(tmp, {**files, name: raw, "manifest.json": _sealed(manifest)})
        _export(root)
        _load(root)


def test_fuzz_checkpoint_files_that_are_not_files(saved):
    """A FIFO or a directory where a file should be is refused at once, never read (a FIFO blocks)."""
    files = saved
    for name in ("manifest.json", "rank0.bin", "state.pt", "latest"):
        with tempfile.TemporaryDirectory() as tmp:
            root = _write_checkpoint(tmp, files)
            target = root / name if name == "latest" else root / "ckpt-1" / name
            target.unlink()
            os.mkfifo(target)
            src = root if name == "latest" else root / "ckpt-1"
            with pytest.raises(checkpoint_read.CheckpointError, match="not a regular file|no manifest|neither"):
                export.export(src, Path(tmp) / "out.safetensors")


# --------------------------------------------------------------------------- profiler traces

@pytest.fixture(scope="module")
def trace_bytes():
    """A real trace: transfers on two streams, compute, a stall, residency samples."""
    prof = Profiler(ProfileConfig(enabled=True, record_function=False), residency=None,
                    peak_rates={"h2d": 2e10, "nvme_read": 3e9})
    t0 = prof.t0_ns
    for i in range(6):
        prof.record(f"u{i:05d}.param", "param", "host", "device", 1 << 20, "prefetch",
                    t0 + i * 1_000_000, t0 + i * 1_000_000 + 700_000, stream="fetch")
        prof.record(f"u{i:05d}.master", "master", "nvme", "host", 1 << 21, "optimizer-read",
                    t0 + i * 1_000_000, t0 + i * 1_000_000 + 900_000, stream="nvme-io")
        prof.record_compute("forward", t0 + i * 1_000_000, t0 + i * 1_000_000 + 800_000, thread="main")
        prof.record_compute("optimizer", t0 + i * 1_000_000, t0 + i * 1_000_000 + 500_000, numel=1000,
                            thread="opt")
    prof.record_wait("u00003.param", t0 + 3_000_000, t0 + 3_200_000, thread="main")
    prof.sample({"device": (1 << 20, 1 << 24), "host": (1 << 22, 1 << 30)})
    prof.prefetch_issued("u00001.param")
    trace = prof.trace()
    prof.close()
    return Blob(json.dumps(trace).encode())


def _profile(raw: bytes, gz: bool):
    """What `zerotier profile` does with a trace file: load, summarize, print the table and JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("trace.json.gz" if gz else "trace.json")
        path.write_bytes(gzip.compress(raw) if gz else raw)
        trace = loads_or_refuses(load_trace, str(path))
        if isinstance(trace, ZerotierError):
            return
        summary = summarize(trace, top=5)
        summary.table()
        json.dumps(summary.to_dict())


@fuzz(150)
@given(gz=st.booleans(), data=st.data())
def test_fuzz_trace_edits(trace_bytes, gz, data):
    _profile(json.dumps(data.draw(edited(json.loads(trace_bytes)))).encode(), gz)


@fuzz(100)
@given(gz=st.booleans(), data=st.data())
def test_fuzz_trace_bytes(trace_bytes, gz, data):
    raw = data.draw(damaged(trace_bytes))
    if gz and data.draw(st.booleans()):  # a damaged gzip stream itself
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json.gz"
            path.write_bytes(data.draw(damaged(gzip.compress(trace_bytes))))
            loads_or_refuses(load_trace, str(path))
        return
    _profile(raw, gz)


# --------------------------------------------------------------------------- safetensors (from_pretrained)

@pytest.fixture(scope="module")
def safetensors_bytes():
    """A real safetensors file of three tensors (what save_pretrained writes)."""
    from safetensors.torch import save

    return Blob(save({"wte.weight": torch.randn(8, 4), "h.0.bias": torch.arange(4, dtype=torch.int64),
                      "ln.weight": torch.ones(4, dtype=torch.bfloat16)}, metadata={"format": "pt"}))


def _read_safetensors(files: dict[str, bytes]):
    """What from_pretrained does with a directory's safetensors files before the model is built:
    open them, list the tensors, read each one's shape and data."""
    from zerotier import pretrained

    with tempfile.TemporaryDirectory() as tmp:
        for name, raw in files.items():
            (Path(tmp) / name).write_bytes(raw)
        try:
            with pretrained._SafetensorsFiles(Path(tmp), *pretrained._libraries()[1:]) as handle:
                for key in handle.where:
                    handle.shape(key)
                    handle.read(key)
        except ZerotierError as exc:
            assert str(exc).strip()


def _with_header(raw: bytes, header) -> bytes:
    """`raw` with its JSON header replaced by `header` (its length prefix fixed)."""
    n = int.from_bytes(raw[:8], "little")
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + raw[8 + n:]


@fuzz(60)
@given(data=st.data())
def test_fuzz_safetensors_bytes(safetensors_bytes, data):
    _read_safetensors({"model.safetensors": data.draw(damaged(safetensors_bytes))})


@fuzz(80)
@given(data=st.data())
def test_fuzz_safetensors_header_edits(safetensors_bytes, data):
    """The header with any one edit (dtype, shape, offsets, names), its length prefix fixed."""
    n = int.from_bytes(safetensors_bytes[:8], "little")
    header = json.loads(safetensors_bytes[8:8 + n])
    _read_safetensors({"model.safetensors": _with_header(safetensors_bytes, data.draw(edited(header)))})


@fuzz(60)
@given(data=st.data())
def test_fuzz_safetensors_index(safetensors_bytes, data):
    """model.safetensors.index.json with any one edit, or damaged, next to its shard."""
    index = {"metadata": {"total_size": 100}, "weight_map": {"wte.weight": "model-00001-of-00001.safetensors",
                                                              "h.0.bias": "model-00001-of-00001.safetensors",
                                                              "ln.weight": "model-00001-of-00001.safetensors"}}
    raw = json.dumps(data.draw(edited(index))).encode()
    if data.draw(st.booleans()):
        raw = data.draw(damaged(raw))
    _read_safetensors({"model.safetensors.index.json": raw, "model-00001-of-00001.safetensors": safetensors_bytes})
