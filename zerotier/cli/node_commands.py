"""`zerotier env` and `zerotier bench`: what this node offers, and what it measures.

Heavy modules are imported when a command runs, so `--help` stays fast (no torch).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from zerotier.cli.values import parameter_count
from zerotier.errors import ZerotierError


# ---------------------------------------------------------------------------------------------
# zerotier env


def env_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print the report as one JSON object (sizes in bytes) instead of text")
    parser.add_argument("--nvme-path", default=".", metavar="PATH",
                        help="directory where NVMe swap files would go; its free space and filesystem "
                             "are reported (default: the current directory)")


def run_env(args: argparse.Namespace) -> int:
    from zerotier import envinfo

    report = envinfo.collect(args.nvme_path)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_rows(env_rows(report))
    return 0


def env_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    from zerotier.units import format_size

    rows: list[tuple[str, str]] = []
    versions = report["versions"]
    if "error" in versions:
        rows.append(("versions", versions["error"]))
    else:
        rows += [("zerotier", versions["zerotier"]), ("torch", versions["torch"]),
                 ("python", versions["python"]), ("platform", versions["platform"])]

    cuda = report["cuda"]
    if "error" in cuda:
        rows.append(("cuda", cuda["error"]))
    elif not cuda["devices"]:
        built = cuda["torch_cuda_version"]
        rows.append(("cuda devices", f"none visible (torch built with CUDA {built})" if built
                     else "none (this torch build has no CUDA)"))
    for dev in cuda.get("devices", ()):
        rows.append((f"cuda:{dev['index']}", f"{dev['name']} (sm {dev['capability']}), "
                     f"{format_size(dev['total_bytes'])} total, {format_size(dev['free_bytes'])} free"))

    cpu = report["cpu"]
    if "error" in cpu:
        rows.append(("cpu", cpu["error"]))
    else:
        rows.append(("cpu", f"{cpu['model']} ({cpu['arch']}), "
                     f"{cpu['physical_cores']} physical / {cpu['logical_cores']} logical cores"))
        have = [flag for flag, present in cpu["simd_flags"].items() if present]
        missing = [flag for flag, present in cpu["simd_flags"].items() if not present]
        listed = " ".join(have) or "none of interest"
        rows.append(("cpu simd flags", listed + (f" (missing: {' '.join(missing)})" if missing else "")))

    memory = report["memory"]
    rows.append(("ram", memory.get("error") or f"{format_size(memory['total_bytes'])} total, "
                 f"{format_size(memory['available_bytes'])} available"))
    if memory.get("cgroup_limit_bytes") is not None:  # the RAM above is already capped by it
        rows.append(("cgroup memory limit", f"{format_size(memory['cgroup_limit_bytes'])} ({memory['cgroup']})"))

    native = report["native"]
    rows += [(f"native {name}", state) for name, state in native.items()]
    rows.append(("simd in use", report["simd_level"]))

    io_uring = report["io_uring"]
    if io_uring["usable"] is None:  # the probe itself is unavailable; its reason says why
        rows.append(("io_uring", io_uring["reason"]))
    else:
        usable = "usable" if io_uring["usable"] else "not usable"
        rows.append(("io_uring", f"{usable}: {io_uring['reason']}" if io_uring["reason"] else usable))

    disk = report["nvme_path"]
    if "error" in disk:
        rows.append(("nvme path", f"error: {disk['error']}"))
    else:
        mount = f" ({disk['filesystem']} on {disk['device']})" if "filesystem" in disk else ""
        rows.append(("nvme path", f"{disk['path']}: {format_size(disk['free_bytes'])} free of "
                     f"{format_size(disk['total_bytes'])}{mount}"))
    return rows


def print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


# ---------------------------------------------------------------------------------------------
# zerotier bench


def bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", nargs="?", default="all",
                        choices=("all", "mem", "pcie", "io", "adam", "step", "compute", "engine"),
                        help="what to measure: all (default), mem (memory bandwidth), pcie (host<->GPU "
                             "copies), io (NVMe read/write with zerotier's engine, and how much it slows the CPU), "
                             "adam (CPU Adam, per optimizer state dtype), step (the optimizer update on the GPU, per "
                             "state dtype), compute (matmul rate of the compute device: `zerotier plan --rates` "
                             "scales unit times by it), engine (the engine's own host time per unit, which a CPU "
                             "device's step adds to compute)")
    parser.add_argument("--path", "--nvme-path", dest="path", default=".", metavar="DIR",
                        help="directory on the drive to test; a temp subdir is made and removed "
                             "(default: the current directory)")
    parser.add_argument("--size", metavar="SIZE",
                        help="bytes per measurement for mem, pcie and io, e.g. 2GiB "
                             "(default 1GiB, pcie 512MiB; with --quick 256MiB mem, 64MiB pcie and io)")
    parser.add_argument("--params", metavar="N", help="parameters for the adam and step measurements (default 50M, step 64M; --quick 8M, "
                         "step 16M)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a rough figure in a few seconds")
    parser.add_argument("--json", action="store_true",
                        help="print the results as JSON (one section: its object, e.g. read_GBps/write_GBps)")
    parser.add_argument("--save", metavar="FILE",
                        help="merge the results into FILE (default $ZEROTIER_BENCH_FILE, else "
                             "~/.cache/zerotier/bench.json), where `zerotier plan` reads them")
    parser.add_argument("--no-save", action="store_true", help="do not save the results")


def run_bench(args: argparse.Namespace) -> int:
    from zerotier import bench
    from zerotier.engine import overhead
    from zerotier.units import parse_size

    sections = bench.SECTIONS + (bench.ENGINE,) if args.what == "all" else (args.what,)
    size = parse_size(args.size, "--size") if args.size is not None else None
    if size == 0:
        raise ZerotierError("--size: must be > 0")
    params = parameter_count(args.params) if args.params is not None else None
    if "io" in sections:
        _check_writable_dir(args.path, "--path/--nvme-path")
    results = bench.run(sections, size=size, params=params, quick=args.quick, path=args.path,
                        engine=overhead.measure)
    if args.json:
        print(json.dumps(results[args.what] if args.what != "all" else results, indent=2))
    else:
        print(bench.format_table(results))
    if not args.no_save:
        where = bench.save(results, args.save)
        print(f"saved to {where}" + (" (`zerotier plan` uses it)" if not args.json else ""), file=sys.stderr)
    return 0


def _check_writable_dir(path: str, option: str) -> None:
    """`path` is a directory a file can be made in (what bench io does), else a one-line error."""
    import tempfile

    if not os.path.isdir(path):
        raise ZerotierError(f"{option} {path}: not an existing directory; give a directory on the drive to measure")
    try:
        tempfile.TemporaryDirectory(prefix="zt-bench-", dir=path).cleanup()
    except OSError as exc:
        raise ZerotierError(f"{option} {path}: cannot create files there ({exc.strerror or exc}); give a writable "
                            "directory on the drive to measure") from None
