"""The step the engine runs, as tasks on shared resources; its critical path is the predicted step.

[Note: the step schedule]
One optimizer step is built as a graph of tasks, each on one resource, each with the
tasks it waits for, in the order the engine issues them:

  resource   what runs on it                                     one at a time because
  compute    each unit's forward and backward                    the compute stream / thread
  cpu        CPU Adam per unit (optimizer thread)                 its threads take every core
  nvme       parameter / gradient / optimizer-state reads and writes   one drive, shared by direction
             (each takes a share of the cores as well: [Note: the drive's share of the cores] in task_graph.py)
  h2d, d2h   parameter fetches and copy-backs, gradient copies    one link per direction
On a CPU device, compute and CPU Adam are the same cores: both run on `compute` (predict.py
sets adam_on), so an early step does not overlap backward there; so do its copies
([Note: a CPU device's copies take its cores]).

[Note: the root's backward comes in two parts]
The root's backward is the head and the loss first, the embeddings (a tied one's sum too) last,
after every block's: unit_timing times that tail apart (`backward_tail_s`), the schedule runs it
after the others' backward, and the units final before it start their state reads that much
earlier (the quick tied GPT, state on NVMe: 22 ms before backward's end in the engine; put first,
the schedule predicted the step 15% long).

[Note: a CPU device's copies take its cores]
On a CPU device the "link" between host and device memory is a memory copy made by a thread:
the compute thread itself for a gradient (copied or added into its accumulator inside the
backward hook: grads_memory.py / grads_nvme.py `accumulate`; gradients kept on the "device" are
copied into theirs the same way), a fetch worker for a
prefetched parameter (params.py; a demand fetch: the compute thread). torch's intra-op threads
already take every core for compute, so such a copy does not run beside compute, as a DMA
engine does on a GPU: it takes the cores compute uses for its duration. With
`StepShape.cpu_device` the `h2d` and `d2h` tasks run on `compute` (first come, first served
with forward and backward), where they were free in parallel before: at 69M parameters that
is the gradient's 276 MB and the fetched parameters' bytes at `mem_copy` per step, added to the
step rather than hidden. The NVMe reads and writes stay on `nvme` (the drive's DMA).

What waits for what (the engine's schedule, engine.py and the stores' Notes):
  * fetches ([Note: prefetch trace]): a pass demands the units in forward order, then in
    backward order; a unit's fetch (NVMe read, then host->device copy) is issued at the
    demand `lookahead` positions earlier, or at the first demand after the unit's previous
    use was released (a unit in use is not fetched twice), or at its own demand; compute of
    a unit waits for its fetch. A pass's first unit is fetched at its own demand.
  * an enclosing unit (the root: `UnitWork.encloses`) is fetched at the pass's start and its
    backward compute runs first (the loss and the head), but for its tail, after every other
    unit's ([Note: the root's backward comes in two parts]); its gradient is final at the end.
  * gradients: host gradients with a CUDA device are copied out (d2h) after the unit's
    backward; NVMe gradients are folded after it (the window's first micro-batch writes the
    file, later ones read, add and write it), at most `grad_writes` folds in flight: the
    next backward waits for the oldest ([Note: gradients on NVMe]).
  * the optimizer, in the window's last micro-batch: with `early_step` (no clipping) each
    unit's Adam starts as soon as its gradient is final, in backward order, on the optimizer
    thread; otherwise after backward and the global norm (a pass over every gradient, `norm_s`:
    engine.step() computes it every window, clipping or not), units whose NVMe state reads were
    issued during backward first, in that order, then the others in unit order ([Note: NVMe
    optimizer pipeline]). The norm waits for the updates started during backward and their
    writes (the policy's wait() before it); with an early step the step ends after it.
    Over several ranks (`unit_final` off) no policy sees a unit final during backward (its reduced
    shard lands at the end): no early step, no speculation, no state read before step().
  * with speculation, the updates under backward and their rollback: [Note: speculation in
    the schedule] below.
  * NVMe optimizer state goes through `pipeline_depth` packed staging sets ([Note: the pipeline
    in the schedule] in state_pipeline.py): a unit's read takes ranges of a set by its bytes. As
    each gradient becomes final in the last backward (not with an early step), its read is issued
    if it fits without waiting; at the window's first final, the read of the unit final last in the
    previous window too. step() updates the units read first, in issue order; before each unit it
    issues the reads of the next NVMe units up to `max(1, pipeline_depth - 2)` ahead, each waiting
    for the oldest writes until it fits (the thread waits with it). Adam waits for its read, the
    write follows Adam. An early or speculated unit reads its own state when the thread takes it
    up. A CPU optimizer reading device or NVMe gradients stages them one unit ahead (two blocks: a
    unit's staging waits for the Adam two units earlier).
  * the new parameters go home after each unit's Adam (`copyback_s`: host->device, or an
    NVMe write); NVMe write-backs stay in flight (at most lookahead + 2: the optimizer waits
    for the oldest) and the next fetch of the unit waits for its write.
  * engine.step() returns when every Adam and optimizer-state write is done; parameter
    write-backs may still be in flight into the next step.

[Note: the device step in the schedule]
A unit whose update the planner put on the device (`UnitWork.device_step`, [Note: choosing
where each update runs] in step_on.py) is issued by the optimizer thread in its turn, as the
engine does ([Note: device staging] in optim/device_staging.py): its state (read from NVMe
first: the thread waits for the read, as above) and gradient, when off the device, staged in on
`h2d`, the kernel on `compute` after them, the state and the new low-precision shard staged out
on `d2h` after it. On a CUDA device the thread does not wait: it goes on at once with the next
unit, so the CPU's units update on `cpu` while the device's copies and kernels run on their own
resources, the parallel sides the split of step_on.py is balanced for. The staging sets
(`device_sets`, DeviceStaging.SETS) bound the units in flight: before the thread issues a device
unit while that many are pending, it waits for the oldest one's staging out (its set), so device
unit k stages in after device unit k - SETS stages out. A device unit is retired after its
staging out: only then is its state written to NVMe and its parameters committed (sent home). The
thread ([Note: the asynchronous device step] in optim/offload.py) retires it at the first of: the
end of a unit it takes up (a CPU update, or a device unit's issue) after its staging out ended (it
looks after each one: [Note: polled tasks] in task_graph.py), the set's reuse (the oldest unit,
waited for; then any other done by then), before it takes up an NVMe unit whose read was not
issued yet (every pending unit, waited for: their write-backs give sets back), the end of the
step() call (every pending unit: engine.step() returns after every retirement and write).
Commits stay in unit order: a CPU unit's parameter commit is held until every device unit before
it is retired (its NVMe state write is not held). A device unit's write-back joins the pipeline's
queue where the model retires it for good (the build cannot know which look found it done), so a
blocking read may wait for other writes first; its commit counts among the write-backs in flight
from its retirement on. Where it waits instead, the thread takes the unit's staging out as its own
end (serial): on a CPU device (`cpu_device`: the "device" kernel runs on the thread's own cores),
and for a unit updated in its own step([unit]) call (an early or speculated unit, whose call ends
by retiring it).

[Note: speculation in the schedule]
With `speculative` (train.overlap: [Note: speculative step] in overlap/speculative.py) the
units marked `speculate` update during the window's last backward as an early step does:
each as its gradient becomes final, in backward order, on the optimizer thread, which takes
every unit up: prefetch(unit) (and at the first, the previous window's last final unit's read),
then a speculated unit's read (waiting for room), update and write (to shadow files); a
speculated host or device unit first makes its undo copy (`undo_s`, on the optimizer's
resource). The global norm still runs after backward; units not speculated (their undo copies
did not fit the plan's allowance) update after it and after the speculated writes (the policy's
wait()), their reads issued under backward first, as without speculation. engine.step() returns when
the norm and every update are done: the commit. The rollback (`rollback`): the same
speculative work; once it and the norm are done, every unit is updated again, in unit
order, after that point, as the non-speculative step does, each speculated host or device
unit first putting its undo copy back (`restore_s`), NVMe units re-reading their pre-step
files (none of those reads was issued during backward). The planner's expected step is
(1 - r) x commit + r x rollback at the rollback rate r (predict.py).

Each resource serves its tasks first come, first served by the time they become ready
(ties: issue order). The prediction simulates two steps and takes the second (steady
state: the first has no write-backs carried in). Its critical path is walked back from the
step's last task through whatever each task waited for last (a task it depends on, or the
task ahead of it on its resource) to the previous step's end; `critical` sums each
component's seconds on it, so they add up to the step time exactly.

Ranks sharing a node share its CPU, memory bus and drive: the caller multiplies those
tasks' seconds by the ranks per node (`ranks_per_node` in planner.py); links are per GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .state_pipeline import StatePipeline, on_nvme
from .task_graph import TaskGraph

RESOURCES = ("compute", "cpu", "nvme", "h2d", "d2h")


@dataclass(frozen=True)
class UnitWork:
    """Seconds of each piece of one unit's work per micro-batch (fetches: per use) or per step."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    fetch_nvme_s: float = 0.0    # parameters read from NVMe into the host pool
    fetch_h2d_s: float = 0.0     # parameters copied host -> device
    grad_d2h_s: float = 0.0      # host gradients on a CUDA device: the fresh gradient copied out
    grad_write_s: float = 0.0    # gradients on NVMe: one fold's write
    grad_read_s: float = 0.0     # gradients on NVMe: one read of the file (a fold after the first, the optimizer's)
    grad_stage_s: float = 0.0    # device gradients read by a CPU optimizer: the shard's d2h copy
    adam_s: float = 0.0
    state_read_s: float = 0.0    # NVMe optimizer state: master + moments read
    state_write_s: float = 0.0   # and written back
    state_bytes: tuple[int, ...] = ()  # NVMe state: its buffers' bytes per key (none: it takes a whole set)
    copyback_s: float = 0.0      # the new parameters sent home
    copyback_on: str = "h2d"     # "h2d" (device home) or "nvme" (an NVMe home's write)
    encloses: bool = False       # resident for the whole pass (the root unit)
    backward_tail_s: float = 0.0  # the encloser's, after the others' ([Note: the root's backward comes in two parts])
    trainable: bool = True       # frozen units have no gradient and no optimizer work
    adam_on: str = "cpu"         # "cpu", or "compute" (optimizer on the device, or a CPU device)
    speculate: bool = False      # its update runs under backward, speculated ([Note: speculation in the schedule])
    undo_s: float = 0.0          # speculated host/device state: its undo copy, before the update (on adam_on)
    restore_s: float = 0.0       # and put back on a rollback
    device_step: bool = False    # host/NVMe state updated on the device ([Note: the device step in the schedule])
    stage_in_s: float = 0.0      # its state (and gradient) staged in over h2d, before the kernel (adam_s)
    stage_out_s: float = 0.0     # its state (and new parameters) staged out over d2h, after it


@dataclass(frozen=True)
class StepShape:
    lookahead: int = 2
    pipeline_depth: int = 3
    accum_steps: int = 1
    clip: bool = False
    early_step: bool = False
    speculative: bool = False    # units with `speculate` update under backward ([Note: speculation in the schedule])
    rollback: bool = False       # with speculative: the step whose global check disagreed (every one redone)
    grad_writes: int = 2         # NVMe gradient folds in flight (GradStore.nvme_writes_in_flight)
    param_writes: int | None = None  # NVMe parameter write-backs in flight (ParamStore.writes_in_flight;
                                     # None: lookahead + 2, what it is)
    state_on_nvme: bool = False
    alignment: int = 4096        # io.alignment: a unit's ranges of a staging set are rounded up to it
    norm_s: float = 0.0          # the global norm's pass over the gradients (every window)
    norm_on: str = "compute"
    streamed: bool = False       # parameters fetched per use (off the device, or ZeRO-3)
    cpu_device: bool = False     # h2d / d2h copies take compute's cores ([Note: a CPU device's copies take its cores])
    device_sets: int = 2         # DeviceStaging.SETS: device units in flight ([Note: the device step in the schedule])
    unit_final: bool = True      # the last backward hands each final unit to the overlap policy (prefetch,
                                 # early step, speculation); not over several ranks (Sharding.active)
    io_share: float = 0.0        # the cores' slowdown while the drive moves data ([Note: the drive's share of the
                                 # cores] in task_graph.py)


@dataclass
class Schedule:
    """The timed step: predicted seconds, each component's total seconds and its seconds on the
    critical path ([Note: the step schedule])."""
    step_s: float
    seconds: dict[str, float] = field(default_factory=dict)
    critical: dict[str, float] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)   # resource -> seconds of work in the step


def _pass(g: TaskGraph, units: list[UnitWork], shape: StepShape, begin: int | None, micro: int,
          home_write: dict[int, int]) -> tuple[int, dict[int, int], list[int]]:
    """One micro-batch's forward and backward ([Note: the step schedule]). Returns the pass's last
    compute task, each unit's 'gradient final' task and the order they became final."""
    n = len(units)
    outer = [i for i in range(n) if units[i].encloses]
    inner = [i for i in range(n) if not units[i].encloses]
    order = outer + inner + outer + inner[::-1]  # demand positions: forward, then backward
    fetched: dict[int, int] = {}
    prev = begin
    folds: list[int] = []
    grad_final: dict[int, int] = {}
    final_order: list[int] = []

    def fetch(pos: int, issue: int | None) -> int:
        u = units[order[pos]]
        read = g.add("params_nvme", "nvme", u.fetch_nvme_s, (issue, home_write.get(order[pos])))
        return g.add("params_h2d", "h2d", u.fetch_h2d_s, (read,))

    for pos, i in enumerate(order):
        u = units[i]
        backward = pos >= n
        if shape.streamed:
            if pos not in fetched:  # nothing prefetched it: fetched at its demand
                fetched[pos] = fetch(pos, prev)
            for nxt in range(pos + 1, min(pos + 1 + shape.lookahead, len(order))):
                unit = order[nxt]  # a unit in use (or used before nxt) is fetched after its release
                if nxt not in fetched and not units[unit].encloses and unit not in order[pos:nxt]:
                    fetched[nxt] = fetch(nxt, prev)
        after = [prev, fetched.get(pos)]
        if backward and len(folds) >= shape.grad_writes > 0:
            after.append(folds[-shape.grad_writes])  # accumulate waits for the oldest fold in flight
        prev = g.add("backward" if backward else "forward", "compute",
                     u.backward_s - u.backward_tail_s if backward else u.forward_s, after)
        if backward and u.trainable and not u.encloses:
            grad_final[i] = _gradient_out(g, u, micro, prev, folds)
            final_order.append(i)
    for i in outer:  # [Note: the root's backward comes in two parts]: its tail after the others'
        if units[i].backward_tail_s:
            prev = g.add("backward", "compute", units[i].backward_tail_s, (prev,))
    for i in outer:  # the enclosing unit's gradient is complete at backward's end
        if units[i].trainable:
            grad_final[i] = _gradient_out(g, units[i], micro, prev, folds)
            final_order.append(i)
    return prev, grad_final, final_order


def _gradient_out(g: TaskGraph, u: UnitWork, micro: int, after: int, folds: list[int]) -> int:
    """A unit's fresh gradient leaves the device and, on NVMe, is folded into its file."""
    last = g.add("grads_d2h", "d2h", u.grad_d2h_s, (after,)) if u.grad_d2h_s else after
    if u.grad_write_s or u.grad_read_s:
        if micro > 0:
            last = g.add("grads_nvme", "nvme", u.grad_read_s, (last,))
        last = g.add("grads_nvme", "nvme", u.grad_write_s, (last,))
        folds.append(last)
    return last


def _optimizer(g: TaskGraph, units: list[UnitWork], shape: StepShape, grad_final: dict[int, int],
               final_order: list[int], backward_end: int, home_write: dict[int, int],
               last_final: int | None) -> list[int]:
    """The window's update ([Note: NVMe optimizer pipeline], [Note: speculation in the schedule]);
    returns the tasks engine.step() waits for. `last_final`: the NVMe unit final last in the
    previous window ([Note: the last final unit's read] in optim/state_store.py)."""
    trainable = [i for i in range(len(units)) if units[i].trainable]

    def norm(after) -> int:  # the global norm, every window, after the policy's wait() ([Note: the step schedule])
        return g.add("grad_norm", shape.norm_on, shape.norm_s, tuple(after))

    up = _Updates(g, units, shape, grad_final, home_write, last_final)
    if shape.speculative:
        ahead = [i for i in final_order if units[i].speculate]
        up.speculate(final_order)
        # engine.step() first waits for the speculated updates and their writes (the policy's wait()),
        # then computes the norm
        gate = norm([g.add("speculation", None, 0.0, [backward_end] + up.updated)])
        up.pipe.drain()
        if not shape.rollback:
            up.run(up.pipe.read_order([i for i in trainable if i not in ahead]), early=False, gate=gate)
            return up.waits + [gate]
        # the global check disagreed: every speculated unit's work is over, then each is restored
        # and every unit is updated with the true coefficient, as the non-speculative step does
        # (rewind drops the reads ahead: the old files are read again)
        up.pipe.drop_reads()
        up.run(trainable, early=False, gate=gate, restore=set(ahead))
        return up.waits + [gate]
    early = shape.early_step and not shape.clip and shape.unit_final
    if early:  # each unit its own step([unit]) as its gradient is final; nothing prefetched
        up.run(list(final_order), early=True, gate=None)
        return up.waits + [norm([backward_end] + up.updated)]
    for i in final_order if shape.unit_final else ():  # prefetch(unit) as each is final, where it fits
        up.pipe.prefetch(i, grad_final[i])
    gate = norm([backward_end])
    up.run(up.pipe.read_order(trainable), early=False, gate=gate)  # reads issued during backward first
    return up.waits + [gate]


@dataclass
class _Pending:
    """A device unit issued and not yet retired ([Note: the device step in the schedule])."""
    unit: int
    lease: int | None   # its NVMe staging set (None: not NVMe, or a read let through without room)
    retired: int        # its retirement: a polled task ([Note: polled tasks] in task_graph.py)
    commit: int | None  # its parameters' write-back, after its retirement (issued in unit order)


class _Updates:
    """The optimizer thread's units in the order given, one `run` per stretch of them (one engine.step()
    call); the staging sets, the optimizer thread and the write-backs in flight carry over from one run
    to the next."""

    def __init__(self, g: TaskGraph, units: list[UnitWork], shape: StepShape, grad_final: dict[int, int],
                 home_write: dict[int, int], last_final: int | None = None):
        self.g, self.units, self.shape, self.grad_final, self.home_write = g, units, shape, grad_final, home_write
        self.pipe = StatePipeline(g, units, shape, last_final)
        self.last_adam: int | None = None  # the optimizer thread's last point
        self.commits: list[int] = []   # parameter write-backs, oldest first
        self.waits: list[int] = []     # what engine.step() waits for
        self.updated: list[int] = []   # each update's end and its NVMe state write: what the policy's wait() waits for
        self.pending: list[_Pending] = []  # device units in flight, oldest first (at most device_sets)
        self.held: list[tuple[int, list[int]]] = []  # commits not issued yet: (write-back, device units before it)

    def speculate(self, final_order: list[int]) -> None:
        """[Note: speculation in the schedule]: the optimizer thread takes each unit up as its gradient
        is final: prefetch(unit) (at the first, the previous window's last final too), then a
        speculated unit's update, its own step([unit])."""
        for i in final_order:
            self.pipe.prefetch(i, self.g.add("speculation", None, 0.0, (self.grad_final[i], self.last_adam)))
            if self.units[i].speculate:
                self.run([i], early=True, gate=None, undo=True)

    def run(self, order: list[int], *, early: bool, gate: int | None, undo: bool = False,
            restore: set[int] = frozenset()) -> None:
        """early: each unit's update starts when its gradient is final (its own step([unit])), else
        after `gate` (UnitOptimizer._step: before each unit, the reads of the next NVMe units, up to
        `depth - 2` ahead of it, waiting for the oldest writes where they do not fit; before a host
        unit only where they fit). undo: each unit's undo copy first (a speculated unit); restore:
        those units' undo copies put back first (a rollback). Device units: [Note: the device step in
        the schedule]."""
        g, units, shape, pipe = self.g, self.units, self.shape, self.pipe
        ahead_reads = max(1, shape.pipeline_depth - 2)
        limit = shape.lookahead + 2 if shape.param_writes is None else shape.param_writes
        nvme_order = [i for i in order if i in pipe.need]
        done = 0
        thread_at: list[int] = []  # the thread's point after each unit of `order`
        read_grad: list[int] = []  # where each unit's staged gradient was read last (its block free again)
        for k, i in enumerate(order):
            u = units[i]
            final = self.grad_final[i]
            read = staged = None
            stalled: list[int] = []
            thread = self.last_adam if early else (thread_at[k - 1] if k else gate)
            issued = u.device_step and not (early or shape.cpu_device)  # issued, not waited
            if self.pending and i in pipe.need and i not in pipe.reads:
                thread = self._retire(list(self.pending), thread)  # a blocking read: every device unit first
            elif issued and len(self.pending) >= shape.device_sets:  # its staging set: the oldest unit's
                thread = self._retire(self.pending[:1], thread)
                self._look(thread)
            if i in pipe.need or (not early and nvme_order[done:]):
                issue = final if thread is None else thread
                for j in nvme_order[done: done + 1 + (0 if early else ahead_reads)]:
                    stalled += pipe.read(j, issue, block=i in pipe.need, now=j == i)
            lease = None
            if i in pipe.need:
                done += 1
                lease, read = pipe.reads.pop(i)
            if u.grad_stage_s or u.grad_read_s:  # two staging blocks: one unit ahead (early: none)
                if early:  # its own step([unit]): staged when the thread takes it up
                    issue = self.last_adam if self.last_adam is not None else final
                else:
                    issue = read_grad[k - 2] if k >= 2 else gate
                res, comp, secs = (("nvme", "grads_nvme", u.grad_read_s) if u.grad_read_s else
                                   ("d2h", "grads_d2h", u.grad_stage_s))
                staged = g.add(comp, res, secs, (issue, final))
            after = [final, read, staged, self.last_adam, thread, None if early else gate] + stalled
            if len(self.commits) > limit:  # that many write-backs in flight: the oldest is waited
                after.append(self.commits[-(limit + 1)])
            # the undo copy is where the state lives: a device-stepped unit's in host memory, by the thread
            copy_on = ("compute" if shape.cpu_device else "cpu") if u.device_step else u.adam_on
            if undo and u.undo_s:  # [Note: speculation in the schedule]: the undo copy, then Adam
                after = [final, g.add("speculation", copy_on, u.undo_s, after)]
            if i in restore and u.restore_s:
                after = [g.add("speculation", copy_on, u.restore_s, after)]
            if issued:
                point = g.add("optimizer", None, 0.0, after)
                staged_in = g.add("optimizer_staging", "h2d", u.stage_in_s, (point,))
                kernel = g.add("optimizer", u.adam_on, u.adam_s, (staged_in,))
                out = g.add("optimizer_staging", "d2h", u.stage_out_s, (kernel,))
                retired = g.add_polled("optimizer", (out,))
                commit = g.add("params_copyback", u.copyback_on, u.copyback_s, (retired,)) if u.copyback_s else None
                self.pending.append(_Pending(i, lease, retired, commit))
                self._look(point)
                thread_at.append(point)
                read_grad.append(staged_in)
                self.last_adam = point
                continue
            if u.device_step:  # serial: the thread waits for its staging out
                staged_in = g.add("optimizer_staging", "h2d", u.stage_in_s, after)
                kernel = g.add("optimizer", u.adam_on, u.adam_s, (staged_in,))
                last = g.add("optimizer_staging", "d2h", u.stage_out_s, (kernel,))
            else:
                last = g.add("optimizer", u.adam_on, u.adam_s, after)
            self._look(last)
            thread_at.append(last)
            read_grad.append(last)
            self.last_adam = last
            self._write(i, last, lease)
            if u.copyback_s:  # held until every device unit before it is retired: commits in unit order
                c = g.add("params_copyback", u.copyback_on, u.copyback_s, [last] + [p.retired for p in self.pending])
                self.held.append((c, [p.unit for p in self.pending]))
                self._committed(i, c)
            self._release()
        if self.pending:  # engine.step() returns once every device unit is retired
            self.last_adam = self._retire(list(self.pending), self.last_adam)

    def _look(self, point: int) -> None:
        """After each unit the thread retires the device units whose staging out is done by `point`."""
        for p in self.pending:
            self.g.poll(p.retired, point)

    def _retire(self, pending: list[_Pending], point: int | None) -> int:
        """The thread waits at `point` for these device units' staging out (oldest first), then writes
        their state home and commits their parameters; returns the thread's point after it."""
        for p in pending:
            if point is not None:
                self.g.poll(p.retired, point)
            self._write(p.unit, p.retired, p.lease)
            if p.commit is not None:  # before the held ones: those are after it in unit order
                self.held.insert(0, (p.commit, []))
                self._committed(p.unit, p.commit)
            self.pending.remove(p)
            self._release()
        return self.g.add("optimizer", None, 0.0, [point] + [p.retired for p in pending])

    def _write(self, i: int, last: int, lease: int | None) -> None:
        """Unit i's update ended at `last` (a device unit's: its retirement): its NVMe state written back."""
        pipe = self.pipe
        if i in pipe.need:
            pipe.writing.append((lease, self.g.add("optimizer_nvme", "nvme", self.units[i].state_write_s, (last,))))
            self.waits.append(pipe.writing[-1][1])
            self.updated.append(pipe.writing[-1][1])
        self.waits.append(last)
        self.updated.append(last)

    def _committed(self, i: int, c: int) -> None:
        self.home_write[i] = c
        if self.units[i].copyback_on != "nvme":
            self.waits.append(c)

    def _release(self) -> None:
        """Held commits whose earlier device units are all retired are issued: from then on they count
        as write-backs in flight (the thread waits for the oldest beyond `param_writes`)."""
        pending = {p.unit for p in self.pending}
        while self.held and not pending.intersection(self.held[0][1]):
            self.commits.append(self.held.pop(0)[0])


def simulate(units: list[UnitWork], shape: StepShape, steps: int = 2) -> Schedule:
    """[Note: the step schedule] The steady-state step: `steps` steps back to back, the last one timed."""
    g = TaskGraph(shape.cpu_device, shape.io_share)
    home_write: dict[int, int] = {}
    step_end: int | None = None
    ends: list[int | None] = []
    last_final: int | None = None  # [Note: the last final unit's read]: none before the first window
    for s in range(steps):
        g.current_step = s
        begin = step_end
        for m in range(shape.accum_steps):
            prev, grad_final, final_order = _pass(g, units, shape, begin, m, home_write)
            begin = prev
        backward_end = g.add("backward", None, 0.0, [prev] + list(grad_final.values()))
        waits = _optimizer(g, units, shape, grad_final, final_order, backward_end, home_write, last_final)
        prefetched = [i for i in final_order if on_nvme(units[i], shape)]
        if shape.unit_final and (not (shape.early_step and not shape.clip) or shape.speculative):
            last_final = prefetched[-1] if prefetched else None  # prefetch() ran: its hint
        step_end = g.add("step", None, 0.0, [backward_end] + waits)
        ends.append(step_end)
    start, end, why = g.run()
    t0 = end[ends[-2]] if steps > 1 else 0.0
    t1 = end[ends[-1]]
    seconds: dict[str, float] = {}
    busy: dict[str, float] = {}
    for t in range(len(g.seconds)):
        if g.step[t] == steps - 1 and g.resource[t] is not None:
            seconds[g.component[t]] = seconds.get(g.component[t], 0.0) + g.seconds[t]
            busy[g.resource[t]] = busy.get(g.resource[t], 0.0) + g.seconds[t]
    critical = {c: 0.0 for c in seconds}
    t = ends[-1]
    while t is not None and end[t] > t0:
        part = end[t] - max(start[t], t0)
        if part > 0:
            critical[g.component[t]] = critical.get(g.component[t], 0.0) + part
        t = why[t]
    return Schedule(t1 - t0, seconds, critical, busy)
