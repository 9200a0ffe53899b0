"""The step model's graph (step_model.py): tasks, each on one resource, each waiting for the tasks it
depends on; run first come, first served per resource.

[Note: polled tasks]
Most tasks wait for all of their dependencies (`after`). A polled task (`polls`) stands for something a
thread does when it next looks: it waits for `after` as usual, and then for the first of its polls (the
thread's points, in the thread's order, their ends increasing) that ends at or after that: the thread
notices it there. When every poll ended earlier, the last one is where the thread waits for it (a
forced point): the task starts as soon as `after` is done. So a device unit is retired at the first CPU
update the optimizer thread ends after its staging out, or where the thread must wait for it ([Note: the
device step in the schedule] in step_model.py). A poll must not depend on its polled task.

[Note: the drive's share of the cores]
While the drive moves data, all-core CPU work runs slower by `io_share` (`zerotier bench io`'s
cpu_share, [Note: the drive's CPU share] in measure.py: the kernel's side of the requests and the
swap files' checksums). So each NVMe task of s seconds brings a task of io_share x s seconds
("nvme_cpu") on the cores' resource: `compute` on a CPU device (torch's threads and the "device"
update take every core there), else `cpu` (the CPU Adam's threads). It follows its transfer (ready
at the transfer's end, nothing waits for it): work on those cores that becomes ready while it runs
waits behind it, as that work is slowed over the transfer; cores idle over the transfer absorb it.
"""
from __future__ import annotations

import heapq


class TaskGraph:
    def __init__(self, cpu_device: bool = False, io_share: float = 0.0):
        # [Note: a CPU device's copies take its cores]: the links are copies on compute's cores there
        self.alias = {"h2d": "compute", "d2h": "compute"} if cpu_device else {}
        self.io_share = io_share                               # [Note: the drive's share of the cores]
        self.cores = "compute" if cpu_device else "cpu"
        self.component: list[str] = []
        self.resource: list[str | None] = []
        self.seconds: list[float] = []
        self.after: list[tuple[int, ...]] = []
        self.polls: dict[int, list[int]] = {}   # polled task -> the thread's points ([Note: polled tasks])
        self.step: list[int] = []
        self.current_step = 0

    def add(self, component: str, resource: str | None, seconds: float, after=()) -> int:
        self.component.append(component)
        self.resource.append(self.alias.get(resource, resource) if seconds > 0 else None)  # nothing to do: no turn
        self.seconds.append(max(0.0, float(seconds)))
        self.after.append(tuple(a for a in after if a is not None))
        self.step.append(self.current_step)
        t = len(self.seconds) - 1
        if resource == "nvme" and seconds > 0 and self.io_share > 0:  # [Note: the drive's share of the cores]
            self.add("nvme_cpu", self.cores, self.io_share * seconds, (t,))
        return t

    def add_polled(self, component: str, after=()) -> int:
        """A zero-second task noticed at the first of its polls after `after` ([Note: polled tasks]); the
        polls are given later, with `poll`, before `run`."""
        t = self.add(component, None, 0.0, after)
        self.polls[t] = []
        return t

    def poll(self, t: int, point: int) -> None:
        """The polled task `t` is looked for at `point` (after its earlier polls, in the thread's order)."""
        self.polls[t].append(point)

    def run(self) -> tuple[list[float], list[float], list[int | None]]:
        """First come, first served per resource by ready time (ties: issue order). Returns each
        task's start, end and the task it waited for last (None: nothing)."""
        n = len(self.seconds)
        waiting = [len(set(a)) for a in self.after]
        users: list[list[int]] = [[] for _ in range(n)]
        for t, deps in enumerate(self.after):
            for d in set(deps):
                users[d].append(t)
        start, end = [0.0] * n, [0.0] * n
        why: list[int | None] = [None] * n
        done = [False] * n
        noticed: dict[int, int] = {}                         # polled task -> the poll it was noticed at
        watching: list[list[tuple[int, float, int]]] = [[] for _ in range(n)]  # poll -> (task, ready, index)
        free: dict[str, tuple[float, int | None]] = {}
        ready: list[tuple[float, int]] = []

        def look(t: int, at: float, k: int) -> None:
            """[Note: polled tasks]: from poll k on, the first that ends at or after `at`."""
            polls = self.polls[t]
            while k < len(polls):
                p = polls[k]
                if not done[p]:
                    watching[p].append((t, at, k))
                    return
                if end[p] >= at:
                    noticed[t] = p
                    heapq.heappush(ready, (end[p], t))
                    return
                k += 1
            heapq.heappush(ready, (at, t))

        def becomes_ready(t: int, at: float) -> None:
            if self.polls.get(t):
                look(t, at, 0)
            else:
                heapq.heappush(ready, (at, t))

        for t in range(n):
            if waiting[t] == 0:
                becomes_ready(t, 0.0)
        while ready:
            at, t = heapq.heappop(ready)
            dep = noticed.get(t, max(self.after[t], key=lambda d: (end[d], d), default=None))
            res = self.resource[t]
            busy_until, last = free.get(res, (0.0, None)) if res is not None else (0.0, None)
            if busy_until > at:
                start[t], why[t] = busy_until, last
            else:
                start[t], why[t] = at, dep
            end[t] = start[t] + self.seconds[t]
            done[t] = True
            if res is not None:
                free[res] = (end[t], t)
            for u in users[t]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    becomes_ready(u, max(end[d] for d in self.after[u]))
            for u, since, k in watching[t]:
                look(u, since, k)
        if not all(done):
            raise AssertionError("the step model's graph has a cycle: a task never became ready")
        return start, end, why
