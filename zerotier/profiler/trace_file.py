"""A trace file: written atomically (plain or gzipped JSON), and read back untrusted.

`load_trace` reads a file that may be damaged, edited or hostile (`zerotier profile` is given any
path): a gzip stream is expanded only up to a bound, and every field the summary and the plot read
is checked for its type and range first, so a bad trace is a ZerotierError naming the field, never
a KeyError or a memory blow-up later. `check_trace_path` refuses at initialize a trace_path the
run could not write at close.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import reprlib
import zlib

from ..errors import ConfigError, ZerotierError
from .schema import SPECULATION_TOTALS
from .trace import FORMAT


def check_trace_path(path: str) -> None:
    """ConfigError now, at initialize, if save_trace(…, path) could not write there at close:
    the directory must exist and take a new file (tried: created and removed), and `path`
    must not be a directory (hostile trial #13: a trace lost after a whole run)."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"profile.trace_path {path} is a directory; give a file name (.json or .json.gz)")
    probe = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"profile.trace_path {path}: cannot create files in {directory} "
                          f"({exc.strerror or exc}); the trace would be lost at close(). Point "
                          f"profile.trace_path at a writable directory") from None


def save_trace(trace: dict, path: str) -> None:
    """Write atomically (temporary name, then rename); gzip when `path` ends in .gz (Perfetto reads both)."""
    data = json.dumps(trace, separators=(",", ":")).encode()
    if path.endswith(".gz"):
        data = gzip.compress(data, compresslevel=6)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        raise ZerotierError(f"cannot write the profiler trace to {path}: {exc.strerror or exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_trace(path: str) -> dict:
    """Read a trace written by zerotier (plain or gzipped JSON); ZerotierError if it is not one."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ZerotierError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    try:
        if raw[:2] == b"\x1f\x8b":
            raw = _gunzip(raw, path)
        trace = json.loads(raw)
    except (OSError, EOFError, zlib.error, ValueError, RecursionError) as exc:  # a cut or damaged gzip stream too
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise ZerotierError(f"{path}: not a JSON trace: {why}") from None
    meta = trace.get("zerotier") if isinstance(trace, dict) else None
    if not isinstance(meta, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ZerotierError(f"{path}: not a zerotier trace (no top-level 'zerotier' object); "
                            "write one with profile.trace_path or Profiler.save()")
    if meta.get("format") != FORMAT:
        raise ZerotierError(f"{path}: trace format {reprlib.repr(meta.get('format'))}, this zerotier reads "
                            f"format {FORMAT}")
    _check_trace(trace, path)
    return trace


# A gzipped trace expands to at most this many times its size (zerotier's traces: 10-30x), and at
# least 256 MiB is always allowed: a "gzip bomb" (1000x and more) is refused before it fills memory.
_MAX_GZIP_RATIO = 100
_MIN_GZIP_LIMIT = 256 << 20


def _gunzip(raw: bytes, path: str) -> bytes:
    limit = max(_MIN_GZIP_LIMIT, _MAX_GZIP_RATIO * len(raw))
    with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ZerotierError(f"{path}: the gzip stream expands to more than {limit >> 20} MiB "
                            f"({_MAX_GZIP_RATIO}x its {len(raw)} bytes): not a trace zerotier wrote (a trace "
                            "compresses 10-30x); refused before it fills memory")
    return data


_MAX_US = 1e18       # times past this are no trace's (µs; 31,000 years)
_MAX_COUNT = 1 << 63
_MAX_BINS = 100_000  # bandwidth bins in the profiled window (build_trace makes BANDWIDTH_BINS)


def _check_trace(trace: dict, path: str) -> None:
    """What read_trace, summarize and plot_trace read is there with its type and in range, so a
    damaged or edited trace is a ZerotierError naming the field, never a KeyError later."""
    def bad(what: str):
        raise ZerotierError(f"{path}: {what} — not a trace zerotier wrote (damaged or edited); "
                            "profile again to get a new one")

    def number(value, name: str, lo: float = -_MAX_US) -> float:
        if type(value) not in (int, float) or not lo <= value <= _MAX_US:  # NaN fails too
            bad(f"{name} is {reprlib.repr(value)}, not a number in [{lo:g}, {_MAX_US:g}]")
        return value

    def count(value, name: str) -> int:
        if type(value) is not int or not 0 <= value < _MAX_COUNT:
            bad(f"{name} is {reprlib.repr(value)}, not a count")
        return value

    def fields(value, name: str, strs=(), counts=(), numbers=(), bools=()) -> None:
        if not isinstance(value, dict):
            bad(f"{name} is {reprlib.repr(value)}, not an object")
        for key in strs:
            if not isinstance(value.get(key), str):
                bad(f"{name}.{key} is {reprlib.repr(value.get(key))}, not a string")
        for key in counts:
            count(value.get(key), f"{name}.{key}")
        for key in numbers:
            number(value.get(key), f"{name}.{key}", 0.0)
        for key in bools:
            if not isinstance(value.get(key), bool):
                bad(f"{name}.{key} is {reprlib.repr(value.get(key))}, not true/false")

    meta = trace["zerotier"]
    window = meta.get("window_us")
    if not isinstance(window, list) or len(window) != 2:
        bad(f"zerotier.window_us is {reprlib.repr(window)}, not [start, end]")
    start, end = (number(t, "zerotier.window_us") for t in window)
    if end < start:
        bad(f"zerotier.window_us ends before it starts ({start}, {end})")
    bin_us = number(meta.get("bandwidth_bin_us"), "zerotier.bandwidth_bin_us", 0.0)
    if bin_us <= 0 or (end - start) / bin_us > _MAX_BINS:
        bad(f"zerotier.bandwidth_bin_us {bin_us} cuts the {end - start} µs window into too many bins")
    peaks = meta.get("peak_rates")
    if peaks is not None:
        fields(peaks, "zerotier.peak_rates")
        for key, rate in peaks.items():
            if rate is not None:
                number(rate, f"zerotier.peak_rates.{key}", 0.0)
    fields(meta.get("prefetch"), "zerotier.prefetch", counts=("issued", "hits", "misses", "wasted"))
    fields(meta.get("vocabulary"), "zerotier.vocabulary")
    reasons = meta["vocabulary"].get("reasons")
    if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
        bad("zerotier.vocabulary.reasons is not a list of strings")
    if meta.get("device") is not None and not isinstance(meta["device"], str):
        bad(f"zerotier.device is {reprlib.repr(meta['device'])}, not a string")
    totals = meta.get("run_totals")
    if totals is not None:  # absent in traces written before it existed
        fields(totals, "zerotier.run_totals", counts=("transfers", "bytes"))
        for group in ("by_link", "by_reason"):
            fields(totals.get(group), f"zerotier.run_totals.{group}")
            for key, value in totals[group].items():
                fields(value, f"zerotier.run_totals.{group}.{key}", counts=("transfers", "bytes"))
    speculation = meta.get("speculation")
    if speculation is not None:  # absent in traces written before it existed
        fields(speculation, "zerotier.speculation", counts=SPECULATION_TOTALS[:-1], numbers=SPECULATION_TOTALS[-1:])
        if speculation["rolled_back_windows"] > speculation["windows"]:
            bad("zerotier.speculation: more windows rolled back than speculated")
    planned = meta.get("planned_rollback_rate")
    if planned is not None and (type(planned) not in (int, float) or not 0 <= planned <= 1):
        bad(f"zerotier.planned_rollback_rate is {reprlib.repr(planned)}, not a share from 0 to 1")
    names = meta.get("unit_names")
    if names is not None:  # absent in traces written before it existed
        fields(names, "zerotier.unit_names", strs=tuple(names) if isinstance(names, dict) else ())
    for i, e in enumerate(trace["traceEvents"]):
        if not isinstance(e, dict):
            bad(f"traceEvents[{i}] is {reprlib.repr(e)}, not an object")
        ph, cat, at = e.get("ph"), e.get("cat"), f"traceEvents[{i}]"
        if ph == "X" and cat in ("transfer", "compute", "stall"):
            ts, dur = number(e.get("ts"), f"{at}.ts"), number(e.get("dur"), f"{at}.dur", 0.0)
            if ts < start - 1 or ts + dur > end + 1:  # build_trace's window holds every X event
                bad(f"{at} [{ts}, {ts + dur}] µs lies outside zerotier.window_us [{start}, {end}]")
            if cat == "transfer":
                fields(e.get("args"), f"{at}.args", strs=("tensor", "role", "src", "dst", "reason", "stream"),
                       counts=("bytes",), numbers=("stall_us",))
            elif cat == "compute":
                fields(e.get("args"), f"{at}.args", strs=("kind", "thread"), counts=("numel",))
            else:
                fields(e.get("args"), f"{at}.args", strs=("tensor", "thread"), bools=("matched",))
        elif ph == "C" and cat == "residency":
            number(e.get("ts"), f"{at}.ts")
            if not isinstance(e.get("name"), str) or not e["name"].startswith("residency "):
                bad(f"{at}.name is {reprlib.repr(e.get('name'))}, not 'residency <tier>'")
            fields(e.get("args"), f"{at}.args", counts=("used", "budget"))
