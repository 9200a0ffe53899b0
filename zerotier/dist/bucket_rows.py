"""A bucket's rows ([Note: buckets] in buckets.py): a unit's flat laid out as N rows of its padded
shard, the copies that pack gradients into them (from host memory by device-tier copies), and the
way back.
"""
from __future__ import annotations

from typing import Sequence

import torch


class Packing:
    """The copies packing one bucket: rows(dst, flat, numel) lays a unit's flat out as
    [Note: buckets] says. Gradients in host memory (`from_host`) move by device-tier H2D copies
    (a gradient in another dtype than the bucket's lands in a device-tier buffer first and is
    cast there); join() makes compute wait for them, wait() makes the host wait (their sources
    may then be written)."""

    def __init__(self, device_tier, from_host: bool):
        self.tier, self.from_host = device_tier, from_host
        self.tickets: list = []

    def rows(self, dst: torch.Tensor, flat: torch.Tensor, numel: int) -> None:
        if not self.from_host:
            pack_rows(dst, flat, numel, _copy)
        elif flat.dtype == dst.dtype:
            pack_rows(dst, flat, numel, self._copy_h2d)
        else:
            moved = self.tier.alloc((numel,), flat.dtype, "gradient for its bucket")
            try:
                self.tier.join(self._copy_h2d(moved, flat))
                pack_rows(dst, moved, numel, _copy)
            finally:
                self.tier.free(moved)

    def _copy_h2d(self, dst: torch.Tensor, src: torch.Tensor):
        ticket = self.tier.copy_h2d(dst, src)
        self.tickets.append(ticket)
        return ticket

    def join(self) -> None:
        for ticket in self.tickets:
            self.tier.join(ticket)

    def wait(self) -> None:
        tickets, self.tickets = self.tickets, []
        for ticket in tickets:
            ticket.wait()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def row_offsets(widths: Sequence[int]) -> list[int]:
    """Where each unit's columns start in a bucket whose units are `widths` columns wide."""
    out, total = [], 0
    for w in widths:
        out.append(total)
        total += w
    return out


def pack_rows(dst: torch.Tensor, flat: torch.Tensor, numel: int, copy) -> None:
    """dst (N x s) = the flat padded with zeros to N*s, row r = chunk r; copy(dst, src) moves the bytes."""
    n_rows, s = dst.shape
    if s == 0:
        return
    full = numel // s
    if full:
        copy(dst[:full], flat[:full * s].view(full, s))
    if full < n_rows:
        rem = numel - full * s
        if rem:
            copy(dst[full, :rem], flat[full * s:numel])
        dst[full, rem:].zero_()
        dst[full + 1:].zero_()


def unpack_rows(out: torch.Tensor, src: torch.Tensor, numel: int) -> None:
    """out (numel) = the first numel elements of src (N x s) read row by row."""
    n_rows, s = src.shape
    if s == 0:
        return
    full = numel // s
    if full:
        out[:full * s].view(full, s).copy_(src[:full])
    rem = numel - full * s
    if rem:
        out[full * s:].copy_(src[full, :rem])
