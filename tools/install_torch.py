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
Where pip fails (the index out of reach, no local wheel), it says what it tried and how to install
torch yourself, and exits with pip's status.
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
    status = subprocess.call(command)
    if status != 0:
        print(failure_help(arguments, build, status), file=sys.stderr)
    return status


def failure_help(arguments: list[str], build: str, status: int) -> str:
    """What was tried and how to install torch yourself, after pip failed (its own message is above)."""
    index = CPU_INDEX if CPU_INDEX in arguments else "the default index (PyPI, or the index pip is configured with)"
    minimum = ".".join(map(str, TORCH_MINIMUM))
    return (f"install_torch: pip could not install torch {TORCH_VERSION} ({build}) from {index}: pip's exit "
            f"status {status}, its reason above.\n"
            f"Install torch {minimum} or newer yourself, then run the command again (this step keeps an "
            "installed torch, whatever its build):\n"
            "  - the command https://pytorch.org/get-started/locally/ gives for this platform;\n"
            f"  - from a network that reaches the index: `python -m pip install {' '.join(arguments)}`;\n"
            f"  - offline, with a torch wheel for this Python copied into DIR: "
            f"`python -m pip install --no-index --find-links DIR torch=={TORCH_VERSION}`.")


if __name__ == "__main__":
    sys.exit(main())
