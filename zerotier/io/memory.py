"""Host buffers for direct I/O.

O_DIRECT transfers DMA straight between the device and user memory, so the buffer
address, the length and the file offset must be multiples of the device's logical block
size (4096 is safe everywhere). `aligned_empty` gives such a buffer as a plain torch uint8
tensor: it over-allocates by one alignment unit and slices at the first aligned address.
The slice holds a reference to the whole allocation, so no extra keepalive is needed, and
it works identically with ZEROTIER_NATIVE=0.
"""
from __future__ import annotations

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


def aligned_empty(nbytes: int, alignment: int = 4096, *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `round_up(nbytes, alignment)` bytes whose
    data_ptr() is a multiple of `alignment`.

    pin_memory=True asks for page-locked memory (only honoured when CUDA is available;
    on CPU-only machines pinned memory degrades to ordinary pageable memory).
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    a = _check_alignment(alignment)
    size = round_up(nbytes, a)
    pin = bool(pin_memory) and torch.cuda.is_available()
    raw = torch.empty(size + a, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % a
    return raw[start:start + size]


def is_aligned(t: torch.Tensor, alignment: int = 4096) -> bool:
    """True if the tensor's address and byte length are multiples of `alignment`."""
    a = _check_alignment(alignment)
    return t.data_ptr() % a == 0 and (t.numel() * t.element_size()) % a == 0
