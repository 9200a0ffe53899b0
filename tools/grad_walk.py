"""The files one unit's gradient passes through, from backward to the CPU Adam, as the code runs.

    python tools/grad_walk.py            # the route, a line per file stay, and the counts
    python tools/grad_walk.py --json     # the same as JSON (for comparing two trees)

A static call walk loses the trail at the first attribute call (`self.window.backward`), so this
one is taken at run time: a profile hook on every thread sees each call into a zerotier/ module
while one backward and optimizer step run (a small decoder, CPU, one rank; parameters on the
device, gradients and optimizer state on the host, clipping at 1.0: the configuration of the
architecture reviews' hand-traced walk). It follows ONE unit, the first whose gradient reaches
zerotier in backward: a call is on the route when an argument is that unit (alone or in a
list) or a tensor sharing storage with one the route handed on (the gradient, its accumulator,
the shard the CPU Adam reads); what such a call returns joins what is followed. Calls that
serve every unit at once without naming one (a window's settle loop) are not the unit's route.

Consecutive calls within one file are one stay; a stay in a file already left is a return.
The figures are of code that ran, so they are comparable across two trees (run it in each).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import zerotier  # noqa: E402
from zerotier.models import TinyGPT  # noqa: E402
from zerotier.state import Unit  # noqa: E402

PKG = str(ROOT / "zerotier") + "/"


def _storage(t) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.numel() else None
    except RuntimeError:
        return None


class Walk:
    """Follows one unit: a call into zerotier/ is on its route when an argument is the unit (alone or in
    a list), or a tensor sharing storage with one the route handed on (the gradient, its accumulator,
    the shard Adam reads); what such a call returns joins the tensors followed."""

    def __init__(self):
        self.on = False
        self.unit = None
        self.storages: set[int] = set()
        self.route: list[tuple[str, str]] = []  # (file relative to zerotier/, function)
        self.live: set[int] = set()  # frames on the route, to follow what they return
        self.lock = threading.Lock()

    def _mine(self, value) -> bool:
        if value is self.unit:
            return True
        if isinstance(value, (list, tuple)) and len(value) < 64:
            return any(v is self.unit for v in value)
        ptr = _storage(value)
        return ptr is not None and ptr in self.storages

    def __call__(self, frame, event, arg):
        if not self.on:
            return
        path = frame.f_code.co_filename
        if not path.startswith(PKG):
            return
        with self.lock:
            if event == "call":
                code = frame.f_code
                args = [frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
                if self.unit is None:  # the first unit handed on in backward, with its gradient
                    units = [a for a in args if isinstance(a, Unit)]
                    grads = [a for a in args if isinstance(a, torch.Tensor)]
                    if not (units and grads):
                        return
                    self.unit = units[0]
                    self.storages.add(_storage(grads[0]))
                if any(self._mine(a) for a in args):
                    self.route.append((path[len(PKG):], frame.f_code.co_qualname))
                    self.live.add(id(frame))
            elif event == "return" and id(frame) in self.live:
                self.live.discard(id(frame))
                values = arg if isinstance(arg, (list, tuple)) else [arg]
                for v in values:
                    ptr = _storage(v)
                    if ptr is not None:
                        self.storages.add(ptr)


def stays(calls):
    route = []
    for f, fn in calls:
        if route and route[-1][0] == f:
            route[-1][1].append(fn)
        else:
            route.append((f, [fn]))
    return route


def walk() -> dict:
    """One unit's route through one backward and optimizer step: {"route": a line per stay,
    "files", "stays", "returns", "file_list"} (tests/test_grad_walk.py pins it)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    engine = zerotier.initialize(model, {
        "offload": {"params": "device", "gradients": "host", "optimizer": "host"},
        "train": {"max_grad_norm": 1.0}})
    x = torch.randint(0, 64, (2, 16))
    opt = engine.optimizer  # the plain loop: loss.backward(); opt.step(); opt.zero_grad()
    for _ in range(2):  # warm: the prefetch trace and first-step work are not the route
        engine(x).sum().backward()
        opt.step()
        opt.zero_grad()
    walk = Walk()
    loss = engine(x).sum()
    sys.setprofile(walk)
    threading.setprofile(walk)
    walk.on = True
    loss.backward()
    opt.step()
    walk.on = False
    sys.setprofile(None)
    threading.setprofile(None)
    engine.close()
    route = stays(walk.route)
    seen, returns = set(), 0
    for f, _ in route:
        returns += f in seen
        seen.add(f)
    files = sorted(seen)
    lines = [f"{f} ({', '.join(dict.fromkeys(fns))})" for f, fns in route]
    return {"route": lines, "files": len(files), "stays": len(route), "returns": returns, "file_list": files}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the route as JSON")
    args = ap.parse_args()
    summary = walk()
    lines = summary["route"]
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    for line in lines:
        print("  " + line[:160])
    print(f"\n{summary['files']} files, {summary['stays']} stays, {summary['returns']} returns to a file already left")
    print("files: " + ", ".join(summary["file_list"]))


if __name__ == "__main__":
    main()
