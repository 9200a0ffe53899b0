"""What this node offers zerotier: versions, accelerators, CPU, RAM, native code, I/O, disk.

`collect()` gathers a plain JSON-serializable dict (sizes in int bytes); `zerotier env`
prints it. Every part is gathered on its own: a part that fails reports
`{"error": "..."}` instead of hiding the rest, since this report is what users run
when something is broken.
"""
from __future__ import annotations

import functools
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import zerotier

# CPU features the native Adam kernels and bf16/fp16 conversions can use.
SIMD_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vbmi", "avx512_bf16", "fma", "f16c")


def collect(nvme_path: str | os.PathLike[str] = ".") -> dict[str, Any]:
    """The environment report; `nvme_path` is where swap files would go (free space is reported)."""
    return {
        "versions": _part(_versions),
        "cuda": _part(_cuda),
        "cpu": _part(_cpu),
        "memory": _part(_memory),
        "native": _part(_native_libraries),
        "simd_level": _simd_level_in_use(),
        "io_uring": _io_uring(),
        "nvme_path": _part(lambda: _disk(Path(nvme_path))),
    }


def _part(gather: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return gather()
    except Exception as exc:  # noqa: BLE001 - one broken probe must not hide the others
        return {"error": f"{type(exc).__name__}: {exc}"}


def _versions() -> dict[str, Any]:
    import torch

    return {
        "zerotier": zerotier.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _cuda() -> dict[str, Any]:
    import torch

    devices = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            free_bytes, total_bytes = torch.cuda.mem_get_info(index)
            devices.append({
                "index": index,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "total_bytes": total_bytes,
                "free_bytes": free_bytes,
            })
    return {"torch_cuda_version": torch.version.cuda, "devices": devices}


@functools.cache
def cpu_info() -> dict[str, Any]:
    """py-cpuinfo's report, gathered once per process (it takes about a second)."""
    import cpuinfo

    return cpuinfo.get_cpu_info()


def _cpu() -> dict[str, Any]:
    import psutil

    info = cpu_info()
    flags = set(info.get("flags", ()))
    return {
        "model": (info.get("brand_raw") or platform.processor() or "unknown").strip(),
        "arch": info.get("arch_string_raw") or platform.machine(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "simd_flags": {flag: flag in flags for flag in SIMD_FLAGS},
    }


def _memory() -> dict[str, Any]:
    memory = usable_memory()
    return {"total_bytes": memory.total, "available_bytes": memory.available,
            "cgroup_limit_bytes": memory.cgroup_limit, "cgroup": memory.cgroup}


# Where /proc and /sys are read from; tests point it at a fake tree.
FS_ROOT = Path("/")
_NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as a huge page-aligned number, v2 as "max"


@dataclass(frozen=True)
class UsableMemory:
    """RAM this process may use: the machine's, capped by its cgroup's memory limit (a container's,
    a Slurm job's). total/available are bytes; cgroup_limit is None (and cgroup "") when no limit applies."""
    total: int
    available: int
    cgroup_limit: int | None
    cgroup: str


def usable_memory() -> UsableMemory:
    """The one reading of RAM size and free RAM that auto budgets, plans and `zerotier env` use.

    [Note: cgroup memory] psutil reports the machine's RAM, which a container or a job does not get:
    in a 700 MiB cgroup a 9 GiB budget is OOM-killed. So every cgroup from this process's own up to
    its hierarchy's root caps it (v2 memory.max, v1 memory.limit_in_bytes; the smallest wins), and
    free RAM is also capped by limit - working set (usage minus inactive file cache, which the
    kernel reclaims before the OOM killer runs, as kubelet counts it).
    """
    import psutil

    ram = psutil.virtual_memory()
    total, available, limit, where = ram.total, ram.available, None, ""
    for directory in _memory_cgroups(FS_ROOT):
        cap = _cgroup_limit(directory)
        if cap is None:
            continue
        headroom = max(0, cap - _cgroup_working_set(directory))
        if limit is None or cap < limit:
            limit, where = cap, str(directory)
        available = min(available, headroom)
    if limit is not None:
        total = min(total, limit)
    return UsableMemory(total=total, available=min(available, total), cgroup_limit=limit, cgroup=where)


def _memory_cgroups(root: Path) -> list[Path]:
    """This process's memory cgroup directories, its own first, then each parent up to the mount."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:  # "hierarchy-id:controllers:path"; v2 is "0::path"
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            mounts = [root / "sys/fs/cgroup", root / "sys/fs/cgroup/unified"]
            mount = next((m for m in mounts if (m / "cgroup.controllers").exists()), None)
        elif "memory" in controllers.split(","):
            mount = root / "sys/fs/cgroup/memory"
        else:
            continue
        if mount is None or not mount.is_dir():
            continue
        own = mount / path.lstrip("/")
        if not own.is_dir():  # a container sees its own cgroup at the mount, under the host's path
            own = mount
        while True:
            found.append(own)
            if own == mount:
                break
            own = own.parent
    return found


def _cgroup_limit(directory: Path) -> int | None:
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            text = (directory / name).read_text().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit() or int(text) >= _NO_LIMIT:
            return None
        return int(text)
    return None


def _cgroup_working_set(directory: Path) -> int:
    usage = 0
    for name in ("memory.current", "memory.usage_in_bytes"):
        try:
            usage = int((directory / name).read_text().strip())
            break
        except (OSError, ValueError):
            continue
    try:
        stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
    except (OSError, ValueError):
        stat = {}
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", "0"))  # v1 hierarchical, v2
    return max(0, usage - int(inactive)) if inactive.isdigit() else usage


def _native_libraries() -> dict[str, str]:
    from zerotier import _native

    return _native.status()


def _simd_level_in_use() -> str:
    """The kernel flavour the optimizer actually runs ("avx512", "avx2", "scalar", "python")."""
    try:
        from zerotier.optim import simd_level

        return str(simd_level())
    except Exception as exc:  # noqa: BLE001 - optimizer package missing or broken
        return f"unavailable: {type(exc).__name__}: {exc}"


def _io_uring() -> dict[str, Any]:
    try:
        from zerotier.io import probe_io_uring

        usable, reason = probe_io_uring()
        return {"usable": bool(usable), "reason": str(reason)}
    except Exception as exc:  # noqa: BLE001 - I/O package missing or broken
        return {"usable": None, "reason": f"unavailable: {type(exc).__name__}: {exc}"}


def _disk(path: Path) -> dict[str, Any]:
    path = path.expanduser().absolute()
    if not path.exists():
        return {"path": str(path), "error": f"{path} does not exist"}
    usage = shutil.disk_usage(path)
    return {
        "path": str(path),
        "total_bytes": usage.total,
        "free_bytes": usage.free,
        **_mount_of(path),
    }


def _mount_of(path: Path) -> dict[str, str]:
    """Filesystem type and device holding `path` (tmpfs, for one, has no O_DIRECT)."""
    import psutil

    real = os.path.realpath(path)
    best = None
    for part in psutil.disk_partitions(all=True):
        inside = real == part.mountpoint or real.startswith(part.mountpoint.rstrip("/") + "/")
        if inside and (best is None or len(part.mountpoint) > len(best.mountpoint)):
            best = part
    if best is None:
        return {}
    return {"filesystem": best.fstype, "device": best.device, "mountpoint": best.mountpoint}
