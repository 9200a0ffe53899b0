"""Faults injected into a live engine's NVMe store (not a test module: the tests import it)."""
from __future__ import annotations

import errno


def fail_nth_write(engine, n: int, code: int = errno.ENOSPC, suffix: str = "") -> list[str]:
    """The n-th NVMe write from now of a key ending in `suffix` (any key with "") fails with `code`
    (the store's own fault injection). Returns the keys of those writes, appended as they are issued."""
    write, seen = engine.store.write, []

    def failing(key, buf, *args, **kwargs):
        if key.endswith(suffix):
            seen.append(key)
            if len(seen) == n:
                engine.store.engine.inject_fault(op="write", errno=code)
        return write(key, buf, *args, **kwargs)
    engine.store.write = failing
    return seen
