"""`zerotier bench`: measure this node's rates and save them for the planner.

Sections (each a function returning a dict of figures; GB = 1e9 bytes):
  mem   memory bandwidth: in-place `mul_` on a large fp32 buffer (read + write bytes) and a
        buffer-to-buffer `copy_` (read + write bytes)
  pcie  with CUDA: host->device and device->host copies from pinned and pageable memory
  io    NVMe write of one fresh file, overwrites of it and reads through zerotier's own engine
        (`open_engine(IOConfig())`, O_DIRECT, aligned buffers), in a temp subdir removed after;
        the overwrite is what training's step writes do (recycled swap files, [Note: NVMe file
        recycling]) and is the planner's and the profiler's nvme_write peak; and cpu_share, how
        much slower all-core CPU work runs while the drive reads and writes ([Note: the drive's
        CPU share] in measure.py): the planner's nvme_cpu_share
  adam  CPU Adam throughput (params/s) of `zerotier.optim.adam_step`: fp32 grads, and the
        mixed form (bf16 grads in, bf16 params out); and each update rule's native variant per
        optimizer state dtype pair (fp32 grads, the engine's call and threads): the planner's
        `cpu_<rule>_<master>_<moments>` ([Note: choosing where each update runs] in planner/step_on.py)
  step  with CUDA: each update rule's device variant per state dtype pair on state staged on the
        device (bytes/s of the kernel's traffic): the planner's `device_<rule>_<master>_<moments>`,
        and AdamW's fp32 pair its `device_adam`; skipped on a CPU-only node (no figure is written:
        the planner keeps every update there on the CPU)
  compute  the compute device's dense matmul rate (flop/s, fp32 and bf16): what `zerotier plan
        --rates FILE` scales measured unit times by ([Note: another node's rates] in planning.py)
  engine  the engine's own host time per unit in a forward and a backward ([Note: the engine's own
        time] in engine/overhead.py): the planner's engine_forward_s / engine_backward_s. Measured
        by the engine's function, which the caller passes (`run(..., engine=...)`: the CLI does);
        not in SECTIONS, the ones this module measures by itself

Results are merged into a JSON file, per host (a home directory may be shared by nodes):

    {"format": 1, "hostname": <last writer>, "timestamp": <last save>,
     "hosts": {"<hostname>": {"timestamp": ..., "mem": {..., "timestamp": ...}, "io": {...}, ...}}}

at `--save PATH`, else $ZEROTIER_BENCH_FILE, else ~/.cache/zerotier/bench.json.
`load_rates()` maps this host's figures to the planner's rate keys (zerotier.planner.predict.DEFAULT_RATES).

The measuring functions are measure.py's. Only `load_rates`/`load`/`bench_file` run at import-light
cost: the planner calls them on every `initialize()`; torch and the engine are imported inside the
measuring functions.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError
from .measure import (DEVICE_STEP_SIZES, QUICK_SIZES, SIZES, STATE_PAIRS, STEP_RULES, Tick, adam_numel, bench_adam,
                      bench_compute, bench_device_step, bench_io, bench_memory, bench_pcie, bench_state_rates)

FORMAT = 1
SECTIONS = ("mem", "pcie", "io", "adam", "step", "compute")
ENGINE = "engine"  # measured by engine/overhead.py's `measure`, given to run() by its caller
# progress-bar ticks per section (pcie, step: CUDA only)
STEPS = {"mem": 3, "pcie": 4, "io": 4, "adam": 2 + len(STEP_RULES), "step": len(STEP_RULES), "compute": 2, ENGINE: 1}


# ---------------------------------------------------------------------------------------------
# driver


class Progress:
    """bench's progress on stderr, drawn by tqdm: a bar on a terminal; elsewhere (a log, CI) the
    same text as one line per step, without the carriage returns a redrawn bar leaves in a file."""

    def __init__(self, total: int, stream=None):
        from tqdm import tqdm

        self.stream = stream if stream is not None else sys.stderr
        self.total, self.done, self.t0 = max(total, 1), 0, time.perf_counter()
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = tqdm(total=self.total, file=self.stream, desc="zerotier bench", unit="step") if tty else None

    def __call__(self, label: str) -> None:
        from tqdm import tqdm

        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update()
            if self.done >= self.total:
                self.bar.close()
            return
        self.stream.write(tqdm.format_meter(self.done, self.total, time.perf_counter() - self.t0, ncols=100,
                                            prefix="zerotier bench", unit="step", postfix=label, ascii=True) + "\n")
        self.stream.flush()


def run(sections: tuple[str, ...] = SECTIONS, *, size: int | None = None, params: int | None = None,
        quick: bool = False, path: str | os.PathLike = ".", progress: Tick | None = None,
        engine: Callable[..., dict[str, Any]] | None = None) -> dict[str, Any]:
    """Measure `sections`; returns {section: figures} (pcie, step: None without CUDA).

    size: bytes for mem/pcie/io (default SIZES, or QUICK_SIZES with quick); params: Adam numel;
    engine: the measuring function of the ENGINE section (zerotier.engine.overhead.measure).
    """
    import torch

    table = QUICK_SIZES if quick else SIZES
    # a CPU-only node has no PCIe link to measure: its section is skipped without a bar
    ticking = [s for s in sections if s not in ("pcie", "step") or torch.cuda.is_available()]
    tick = progress or Progress(sum(STEPS[s] for s in ticking))
    results: dict[str, Any] = {}
    for section in sections:
        if section == "mem":
            results["mem"] = bench_memory(size or table["mem"], repeat=3 if quick else 5, tick=tick)
        elif section == "pcie":
            results["pcie"] = bench_pcie(size or table["pcie"], repeat=3 if quick else 5, tick=tick)
        elif section == "io":
            results["io"] = bench_io(path, size or table["io"], tick=tick)
        elif section == "adam":
            numel = params or adam_numel(table["adam"])
            results["adam"] = {**bench_adam(numel, repeat=3, tick=tick), **bench_state_rates(numel, repeat=3, tick=tick)}
        elif section == "step":
            results["step"] = bench_device_step(params or DEVICE_STEP_SIZES["quick" if quick else "full"], repeat=3,
                                                tick=tick)
        elif section == "compute":
            results["compute"] = bench_compute(table["compute"], repeat=3, tick=tick)
        elif section == ENGINE:
            if engine is None:
                raise ValueError("bench section 'engine' is measured by the engine's own function: "
                                 "run(..., engine=zerotier.engine.overhead.measure)")
            results[ENGINE] = engine(rounds=7 if quick else 15, tick=tick)
        else:
            raise ValueError(f"unknown bench section {section!r}; choose from {', '.join(SECTIONS)}")
    return results


def _rule_pairs():
    """Every (update rule, master dtype, moments dtype) the adam and step sections measure."""
    return [(rule, master, moments) for rule in STEP_RULES for master, moments in STATE_PAIRS]


def format_table(results: dict[str, Any]) -> str:
    """The measured figures as aligned text rows."""
    from .units import format_size

    rows: list[tuple[str, str]] = []
    mem = results.get("mem")
    if mem:
        note = f"({format_size(mem['bytes'])} buffer, {mem['threads']} threads; read+write bytes)"
        rows += [("memory in-place mul_", f"{mem['inplace_GBps']:7.2f} GB/s  {note}"),
                 ("memory copy_", f"{mem['copy_GBps']:7.2f} GB/s")]
        if "sumsq_GBps" in mem:
            rows.append(("gradient norm pass", f"{mem['sumsq_GBps']:7.2f} GB/s  (the engine's sum of squares, read only)"))
    if "pcie" in results:
        pcie = results["pcie"]
        if pcie is None:
            rows.append(("pcie", "skipped: no CUDA device (CPU-only node)"))
        else:
            for key in ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
                rows.append((f"{key.replace('_', ' ')}", f"{pcie[key + '_GBps']:7.2f} GB/s  ({pcie['device']})"))
    io = results.get("io")
    if io:
        how = f"({format_size(io['bytes'])}, {io['backend']}, " + ("O_DIRECT" if io["o_direct"] else
                                                                 "buffered: no O_DIRECT here") + f", {io['path']})"
        rows.append(("nvme write, fresh file", f"{io['write_GBps']:7.2f} GB/s  {how}"))
        if io.get("overwrite_GBps"):
            rows.append(("nvme overwrite", f"{io['overwrite_GBps']:7.2f} GB/s  (a step's swap writes)"))
        rows.append(("nvme read", f"{io['read_GBps']:7.2f} GB/s"))
        if io.get("cpu_share") is not None:
            rows.append(("cpu slowdown under nvme", f"{100 * io['cpu_share']:6.1f} %     (all-core work while the drive "
                                                    "reads and writes: the planner's nvme_cpu_share)"))
        if io.get("crc32c_GBps"):  # the checksum of every swap file, on the writing/reading thread
            rate = io.get("overwrite_GBps") or io["write_GBps"]   # a step's swap writes are overwrites
            rows.append(("swap checksum crc32c", f"{io['crc32c_GBps']:7.2f} GB/s  (one core; "
                                                 f"+{100 * rate / io['crc32c_GBps']:.0f}% to a swap write's time "
                                                 f"at {rate:.2f} GB/s)"))
    adam = results.get("adam")
    if adam:
        note = f"({adam['numel'] / 1e6:.0f}M params, {adam['simd']}, {adam['threads']} threads)"
        rows += [("cpu adam fp32", f"{adam['fp32_params_per_s'] / 1e9:7.2f} G params/s  {note}"),
                 ("cpu adam bf16 grad+out", f"{adam['bf16_params_per_s'] / 1e9:7.2f} G params/s")]
        for rule, master, moments in _rule_pairs():
            value = adam.get(f"{rule}_{master}_{moments}_params_per_s")
            if value:
                rows.append((f"cpu {rule} {master} master, {moments} moments", f"{value / 1e9:7.2f} G params/s"))
    if "step" in results:
        step = results["step"]
        if step is None:
            rows.append(("device step", "skipped: no CUDA device (the update stays on the CPU)"))
        else:
            rows += [(f"device {rule} {master} master, {moments} moments",
                      f"{step[f'{rule}_{master}_{moments}_GBps']:7.2f} GB/s  (kernel bytes, "
                      f"{step['numel'] / 1e6:.0f}M params on {step['device']})") for rule, master, moments in _rule_pairs()]
    compute = results.get("compute")
    if compute:
        note = f"({compute['side']}^2 matmul on {compute['device']})"
        rows += [("matmul fp32", f"{compute['fp32_flops'] / 1e12:7.3f} TFLOP/s  {note}"),
                 ("matmul bf16", f"{compute['bf16_flops'] / 1e12:7.3f} TFLOP/s")]
    eng = results.get(ENGINE)
    if eng:
        note = f"(a unit of a {eng['units']}-unit TinyGPT, engine minus plain torch, {eng['threads']} threads)"
        rows += [("engine forward, per unit", f"{eng['forward_per_unit_s'] * 1e3:7.3f} ms  {note}"),
                 ("engine backward, per unit", f"{eng['backward_per_unit_s'] * 1e3:7.3f} ms")]
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---------------------------------------------------------------------------------------------
# saved results


def bench_file(path: str | os.PathLike | None = None) -> Path:
    """Where results are saved: `path`, else $ZEROTIER_BENCH_FILE, else ~/.cache/zerotier/bench.json."""
    if path:
        return Path(path).expanduser()
    env = os.environ.get("ZEROTIER_BENCH_FILE")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "zerotier" / "bench.json"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        warnings.warn(f"{path}: cannot read saved zerotier bench results ({exc}); ignoring them",
                      RuntimeWarning, stacklevel=3)
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("hosts"), dict):
        warnings.warn(f"{path}: not a zerotier bench file of format {FORMAT}; ignoring it",
                      RuntimeWarning, stacklevel=3)
        return None
    return data


def save(results: dict[str, Any], path: str | os.PathLike | None = None) -> Path:
    """Merge `results` into this host's entry of the bench file (atomically); returns its path."""
    target = bench_file(path)
    data = _read(target) or {"format": FORMAT, "hosts": {}}
    host, now = socket.gethostname(), _now()
    entry = data["hosts"].setdefault(host, {})
    for section, figures in results.items():
        entry[section] = {**figures, "timestamp": now} if figures is not None else {"skipped": True,
                                                                                   "timestamp": now}
    entry["timestamp"] = now
    data.update(hostname=host, timestamp=now)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)
    return target


def load(path: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """This host's saved entry ({section: figures, "timestamp": ...}), or None."""
    data = _read(bench_file(path))
    if data is None:
        return None
    entry = data["hosts"].get(socket.gethostname())
    return entry if isinstance(entry, dict) else None


def load_rates(path: str | os.PathLike | None = None) -> dict[str, float] | None:
    """This host's saved figures as the planner's rates (None when nothing usable is saved)."""
    return entry_rates(load(path))


def rates_from_file(path: str | os.PathLike) -> dict[str, float]:
    """The rates of a bench file written on another node ([Note: another node's rates] in
    planning.py): its one host's entry, or the most recently saved one. The user named this file,
    so unlike this node's cache it is checked strictly: ConfigError naming the file and the key."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it as a zerotier bench file ({exc}); write one with "
                          "`zerotier bench --save FILE` on the node to plan for") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("hosts"), dict):
        raise ConfigError(f"{path}: not a zerotier bench file (expected a JSON object with format {FORMAT} and a "
                          "hosts object); write one with `zerotier bench --save FILE` on the node to plan for")
    for host, entry in data["hosts"].items():
        _check_entry(path, host, entry)
    entries = list(data["hosts"].values())
    rates = entry_rates(max(entries, key=lambda e: str(e.get("timestamp", "")), default=None))
    if rates is None:
        raise ConfigError(f"{path}: no zerotier bench results in it (write one with `zerotier bench --save FILE` "
                          "on the node to plan for)")
    return rates


# The figures entry_rates reads, by section, with the factor to the rate's unit (bytes, flop or params /s).
_FIGURES = {"pcie": {"h2d_pinned_GBps": 1e9, "d2h_pinned_GBps": 1e9},
            "io": {"read_GBps": 1e9, "overwrite_GBps": 1e9, "write_GBps": 1e9},
            "mem": {"copy_GBps": 0.5e9, "inplace_GBps": 1e9, "sumsq_GBps": 1e9},
            "adam": {"fp32_params_per_s": 1.0, **{f"{r}_{m}_{mo}_params_per_s": 1.0 for r, m, mo in _rule_pairs()}},
            "step": {f"{r}_{m}_{mo}_GBps": 1e9 for r, m, mo in _rule_pairs()},
            "compute": {"fp32_flops": 1.0, "bf16_flops": 1.0},
            ENGINE: {}}  # seconds per unit, not rates: checked by _is_unit_seconds
# A figure is a number whose rate lies in this range (1 to 10^18 per second): outside it a
# prediction is 0 s or overflows.
_RATE_RANGE = (1.0, 1e18)


def _is_unit_seconds(value: Any) -> bool:
    """The engine's own time per unit ([Note: the engine's own time]): from 0 to 1 s."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0


def _is_share(value: Any) -> bool:
    """A slowdown fraction ([Note: the drive's CPU share]): from 0 (none) to 10 (eleven times slower)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 10.0


def _is_rate(value: Any, factor: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and _RATE_RANGE[0] <= value * factor <= _RATE_RANGE[1])


def _check_entry(path: Path, host: str, entry: Any) -> None:
    where = f"{path}: hosts.{host}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected an object of bench sections, got {type(entry).__name__}")
    for section, fields in _FIGURES.items():
        figures = entry.get(section)
        if figures is None:  # not measured
            continue
        if not isinstance(figures, dict):
            raise ConfigError(f"{where}.{section}: expected an object of figures, got {type(figures).__name__}")
        for field, factor in fields.items():
            value = figures.get(field)
            if value is not None and not _is_rate(value, factor):
                raise ConfigError(f"{where}.{section}.{field}: expected a measured rate, a number from "
                                  f"{_RATE_RANGE[0] / factor:g} to {_RATE_RANGE[1] / factor:g}, got {value!r}")
        if section == ENGINE:
            for field in ("forward_per_unit_s", "backward_per_unit_s"):
                if figures.get(field) is not None and not _is_unit_seconds(figures[field]):
                    raise ConfigError(f"{where}.engine.{field}: expected the measured seconds per unit, a number "
                                      f"from 0 to 1, got {figures[field]!r}")
        if section == "io" and figures.get("cpu_share") is not None and not _is_share(figures["cpu_share"]):
            raise ConfigError(f"{where}.io.cpu_share: expected the measured slowdown, a number from 0 to 10, got "
                              f"{figures['cpu_share']!r}")
        if section == "io" and not isinstance(figures.get("o_direct", False), bool):
            raise ConfigError(f"{where}.io.o_direct: expected true or false, got {figures['o_direct']!r}")


def entry_rates(entry: dict[str, Any] | None) -> dict[str, float] | None:
    """One host's figures as the planner's rates: h2d, d2h, nvme_read, nvme_write, mem_copy,
    mem_read (bytes/s), cpu_adam (params/s, fp32 grads: what the engine's fp32 accumulators feed),
    cpu_<rule>_<master>_<moments> (params/s, per state dtype pair), device_<rule>_<master>_<moments>
    and device_adam (the device step's kernel bytes/s; device_adam is AdamW's fp32 pair),
    compute_fp32 / compute_bf16 (matmul flop/s); only the keys measured. NVMe figures taken
    without O_DIRECT (page cache) are left out. nvme_write is the overwrite rate (a step's
    writes), the fresh-file rate only in files saved before it was measured. The memory
    figures count read + write bytes: a copy of B bytes moves 2B (mem_copy is half of copy_);
    mem_read is the global norm's read pass, the engine's sum-of-squares kernel over B bytes
    (files written before it was measured: the in-place rate, else the copy's read + write bytes/s,
    which a read-only pass of the same memory at least matches). cpu_params_out 0 marks CPU update rates
    timed without the new parameters written ([Note: the CPU rate's new parameters] in planner/step_on.py).
    nvme_cpu_share is a fraction, not a
    rate: io's cpu_share ([Note: the drive's CPU share] in measure.py)."""
    if not entry:
        return None
    rates: dict[str, float] = {}
    sections = {name: entry.get(name) if isinstance(entry.get(name), dict) else {} for name in _FIGURES}
    pcie, io, adam, mem, compute, step = (sections[name] for name in ("pcie", "io", "adam", "mem", "compute", "step"))
    per_state = {}
    for rule in STEP_RULES:
        for m, mo in STATE_PAIRS:
            per_state[f"cpu_{rule}_{m}_{mo}"] = (adam, f"{rule}_{m}_{mo}_params_per_s", 1.0)
            per_state[f"device_{rule}_{m}_{mo}"] = (step, f"{rule}_{m}_{mo}_GBps", 1e9)
    for key, (section, field, factor) in {
            "h2d": (pcie, "h2d_pinned_GBps", 1e9), "d2h": (pcie, "d2h_pinned_GBps", 1e9),
            "nvme_read": (io, "read_GBps", 1e9),
            "nvme_write": (io, "overwrite_GBps" if "overwrite_GBps" in io else "write_GBps", 1e9),
            "mem_copy": (mem, "copy_GBps", 0.5e9),
            "mem_read": (mem, next((f for f in ("sumsq_GBps", "inplace_GBps", "copy_GBps") if f in mem),
                                   "sumsq_GBps"), 1e9),
            "cpu_adam": (adam, "fp32_params_per_s", 1.0),
            "device_adam": (step, "adamw_fp32_fp32_GBps", 1e9),
            "compute_fp32": (compute, "fp32_flops", 1.0), "compute_bf16": (compute, "bf16_flops", 1.0),
            **per_state}.items():
        value = section.get(field)
        if _is_rate(value, factor) and (section is not io or io.get("o_direct")):
            rates[key] = float(value) * factor
    if any(key.startswith("cpu_") for key in rates) and adam.get("params_out") is not True:
        rates["cpu_params_out"] = 0.0  # timed before the update's new parameters were: [Note: the CPU rate's new parameters]
    if _is_share(io.get("cpu_share")) and io.get("o_direct"):  # [Note: the drive's CPU share]: a fraction
        rates["nvme_cpu_share"] = float(io["cpu_share"])
    engine = entry.get(ENGINE) if isinstance(entry.get(ENGINE), dict) else {}
    for key, field in (("engine_forward_s", "forward_per_unit_s"), ("engine_backward_s", "backward_per_unit_s")):
        if _is_unit_seconds(engine.get(field)):  # [Note: the engine's own time] in engine/overhead.py
            rates[key] = float(engine[field])
    return rates or None

