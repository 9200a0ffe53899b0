"""Host buffers for direct I/O.

O_DIRECT transfers DMA straight between the device and user memory, so the buffer
address, the length and the file offset must be multiples of the device's logical block
size (4096 is safe everywhere). `aligned_empty` gives such a buffer as a plain torch uint8
tensor: it over-allocates by one alignment unit and wraps the bytes from the first aligned
address in a tensor of their own, which keeps the whole allocation alive. It works
identically with ZEROTIER_NATIVE=0.

[Note: the storage starts at the aligned address]
The tensor is not a slice of the over-allocation: its *storage* begins at the aligned
address. torch answers `is_pinned()` for the storage's first byte, and the host pool
page-locks exactly the aligned range (cudaHostRegister of data_ptr(), size): a slice's
storage begins before that range, so torch saw every registered block as pageable and made
every "non_blocking" copy from it synchronous (first GPU run, H200: 6 synchronizing copies in
a warm optimizer step, tests/test_cuda.py::test_no_host_sync_in_forward_and_backward).
Registering the whole over-allocation instead would overlap the pages of a neighbouring heap
chunk, which the driver refuses (712).
"""
from __future__ import annotations

import ctypes

import torch


def _check_alignment(alignment: int) -> int:
    alignment = int(alignment)
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 1, got {alignment}")
    return alignment


def round_up(nbytes: int, alignment: int = 4096) -> int:
    """`nbytes` rounded up to a multiple of `alignment` (a power of two)."""
    a = _check_alignment(alignment)
    return (int(nbytes) + a - 1) & ~(a - 1)


def aligned_empty(nbytes: int, alignment: int = 4096) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `round_up(nbytes, alignment)` bytes whose
    data_ptr() is a multiple of `alignment` and is its storage's first byte
    ([Note: the storage starts at the aligned address])."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    a = _check_alignment(alignment)
    size = round_up(nbytes, a)
    raw = torch.empty(size + a, dtype=torch.uint8)
    start = (-raw.data_ptr()) % a
    if size == 0:
        return raw[:0]
    window = (ctypes.c_uint8 * size).from_address(raw.data_ptr() + start)
    window.allocation = raw  # the tensor holds `window` (buffer protocol), `window` holds `raw`
    return torch.frombuffer(window, dtype=torch.uint8)


def is_aligned(t: torch.Tensor, alignment: int = 4096) -> bool:
    """True if the tensor's address and byte length are multiples of `alignment`."""
    a = _check_alignment(alignment)
    return t.data_ptr() % a == 0 and (t.numel() * t.element_size()) % a == 0
