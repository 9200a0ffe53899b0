"""Interval arithmetic on sorted, disjoint [start, end) lists (µs floats), for busy time and overlap."""
from __future__ import annotations

import bisect
from typing import Iterable

Intervals = list[tuple[float, float]]


def union(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """Sorted, disjoint, non-empty intervals covering the same time."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        elif e > s:
            out.append([s, e])
    return [(s, e) for s, e in out]


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """`a` minus `b` (both sorted and disjoint)."""
    out = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def length(intervals: Intervals) -> float:
    return sum(e - s for s, e in intervals)


def overlap(s: float, e: float, intervals: Intervals) -> float:
    """Length of [s, e) inside the sorted, disjoint `intervals`."""
    total = 0.0
    k = max(0, bisect.bisect_right(intervals, (s, float("inf"))) - 1)
    while k < len(intervals) and intervals[k][0] < e:
        total += max(0.0, min(e, intervals[k][1]) - max(s, intervals[k][0]))
        k += 1
    return total
