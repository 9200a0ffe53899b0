"""Install torch into this Python environment unless one is there, in the build that fits the host.

The README's two commands run this before `pip install -e .`, which then keeps the torch it finds
(pyproject.toml leaves torch unpinned, so pip never swaps an installed build for another):

- a torch that is already installed (at least the version pyproject.toml requires) is kept, whatever
  its build (CUDA, ROCm, CPU, a source build);
- on Linux with an NVIDIA driver: torch from the default index (PyPI's Linux wheel is the CUDA build);
- on Linux without one: the CPU wheel from PyTorch's CPU index (PyPI's Linux wheel would pull 2.8 GiB
  of wheels, 16 of them CUDA packages, that a CPU-only host cannot use);
- on macOS and Windows: the default index, whose wheels there carry no CUDA libraries.

For another build (ROCm, another CUDA version) install torch first as pytorch.org says; it is kept.
Run with the Python of the environment to install into (the venv's `python`). No dependencies.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys

TORCH_VERSION = "2.13.0"                    # the version CI and the test suite run on
TORCH_MINIMUM = (2, 11)                     # pyproject.toml's "torch>=2.11" (tests/test_install_hints.py)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"   # pytorch.org's command for Linux, CPU


def installed_torch() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_driver() -> bool:
    # /dev/nvidiactl exists where the driver is loaded and, in a container, only where the GPUs
    # were passed in; nvidia-smi covers hosts that create the device nodes lazily.
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def pip_arguments(installed: str | None, has_nvidia_driver: bool, platform: str) -> list[str] | None:
    """The `pip install` arguments for this host's torch; None keeps the installed one."""
    if installed is not None and _release(installed) >= TORCH_MINIMUM:
        return None
    if platform.startswith("linux") and not has_nvidia_driver:
        # --index-url, not --extra-index-url: pip then cannot resolve torch to PyPI's CUDA wheel.
        # --retries 2 (pip's default is 5, with back-off): where the index cannot be reached and a
        # local wheel folder (pip's find-links) serves torch, pip gives up on the index in ~10 s, not
        # ~3.5 min, and installs the local wheel.
        return [f"torch=={TORCH_VERSION}", "--index-url", CPU_INDEX, "--retries", "2"]
    return [f"torch=={TORCH_VERSION}"]


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0,)


def main() -> int:
    installed, has_driver = installed_torch(), nvidia_driver()
    arguments = pip_arguments(installed, has_driver, sys.platform)
    if arguments is None:
        print(f"install_torch: torch {installed} is installed in {sys.prefix}: kept")
        return 0
    build = "CPU build" if CPU_INDEX in arguments else (
        "CUDA build: an NVIDIA driver is present" if has_driver else "default build")
    replacing = f" (replacing torch {installed}, older than zerotier needs)" if installed else ""
    command = [sys.executable, "-m", "pip", "install", *arguments]
    print(f"install_torch: torch {TORCH_VERSION}, {build}{replacing}: {' '.join(command)}", flush=True)
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
