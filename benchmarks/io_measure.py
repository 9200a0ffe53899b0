"""What the I/O benchmarks share (bench_io.py, io_backends.py): sizes as written on the command
line, process CPU seconds, settling the filesystem between timed phases, one direction's figures.
"""
from __future__ import annotations

import argparse
import os
import re
import resource
from dataclasses import dataclass


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20, "mib": 1 << 20,
          "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


def cpu_seconds(who=resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def settle() -> None:
    """Flush dirty metadata and let the filesystem finish freeing deleted files (with
    `-o discard`, ext4 issues the discards at journal commit) so that work is not billed
    to whichever run comes next."""
    os.sync()


@dataclass
class Result:
    gbps: float
    cpu_per_gb: float
