"""Where each unit's optimizer update runs: on the CPU or on the device (`Plan.optimizer_step_on`).

[Note: where the update runs]
A unit's optimizer state keeps its home (tiers/homes.py); where its update runs is a second,
separate choice, one per trainable unit in unit index order:

  "cpu"      the native CPU kernel updates the state where it lives (host memory, or an NVMe
             staging set)
  "device"   the state is on the device, or is staged to it, updated there and written back

`optimizer.step_on` chooses: "cpu" or "device" put every host/NVMe unit there; state homed on
the device is updated where it lives whatever the key says ("device"). "auto" lets the planner
split the host/NVMe units between the two ([Note: choosing where each update runs]).

[Note: choosing where each update runs]
The split is balanced for the two sides running in parallel after backward, as the engine runs
them on a CUDA device: the optimizer thread steps its units with the native CPU kernel, and
issues the device's units without waiting for them, which then run on a pipeline of three
stages, each on its own resource (the H2D link, the device, the D2H link). Per parameter of a
unit's shard (B: the state's bytes per parameter, `StateLayout.bytes_per_param`):

  cpu       ranks_per_node / cpu_adam          (the node's cores, shared by its ranks; the rate
                                               of the rule and the state's dtypes where `zerotier
                                               bench` measured it, `cpu_<rule>_<master>_<moments>`,
                                               else the fp32 Adam rate `cpu_adam`: `cpu_rate_key`)
  device    in   (B + the gradient's bytes if the gradients are not on the device
                  + the new parameters' bytes if they come back to the device) / h2d
            kernel (2 B + the gradient's bytes) / device_adam   (state read and written, the
                                               gradient read: 28 B/param with fp32 Adam, the
                                               DEVICE_ADAM_BYTES of predict.py; the rate of the
                                               rule and dtypes, `device_<rule>_<master>_<moments>`,
                                               where measured, else `device_adam`: `device_rate_key`)
            out  (B + the new parameters' bytes unless written in place) / d2h

[Note: the CPU rate's new parameters]
The native kernel also writes each unit's new parameters out (ParamStore.out_buffer), in the
parameters' dtype. `zerotier bench adam` times it writing them in the master's dtype (fp32
Adam: 32 B/param moved, against 28 without them: 1.42 against 1.79 G params/s on this VM at 8M
parameters). The kernel is bound by memory, so a rate measured so is scaled by the bytes moved
(`cpu_out_scale`): 2 x the state's bytes + the gradient's + the new parameters'. A bench file
written before (benchmarks/nodes/h200.json) has rates timed without them: its rates carry
`cpu_params_out` 0 (`bench.entry_rates`), and they are scaled from the bytes moved without any
(`out_bytes_at`). Timed without
them, the rate overstated the engine's update by 25% or more (the quick GPT-2's 5.3M parameters
took 5.5 ms a step, against 3.0 ms planned).

[Note: the new shard's way home]
Where the parameters' home is device memory holding exactly the unit's shard (one rank, ZeRO-0,
or ZeRO-3's own shard: `shard_in_place`, ParamStore.device_out's rule), the device update writes
the new shard there in place: nothing goes out or comes back, and the commit has nothing to copy.
Elsewhere it goes out to the parameter store's host output buffer, and a device home (ZeRO-1/2
over several ranks, gathered from there) gets it back by the commit's H2D copy, as after a CPU
update (`params_copyback` in predict.py); a host or NVMe home is written from that buffer.

The device side's time for units S is then max(in, kernel, out) x params(S), the pipeline's
slowest stage, plus its fill: the other two stages of the largest unit of S. The CPU's is
cpu x params(S'). The split minimizes the later of the two finish times. Greedy, by unit size,
largest first (LPT): each unit goes to the side that would finish earlier with it, ties to the
CPU. Near-optimal: let X be the side that finishes last and j the last unit put there; when j
was placed, X with j finished no later than the other side Y would have with j, and Y only grew
since, so the split's time is at most Y's finish + j's cost on Y. Any split, even one cutting
units in pieces, takes at least the time where the two sides meet, which lies between Y's and
X's finish: the greedy is within one unit's update (its smallest units: placed last) of the
optimum. A device budget without room for the staged units in flight keeps every unit on the
CPU; `device` forced without that room is refused (PlanDoesNotFit).

The step's schedule runs the device's units beside the CPU's as the engine does ([Note: the
device step in the schedule] in step_model.py): issued in the thread's order, at most
`DeviceStaging.SETS` in flight, their write-backs and commits after they are retired. What the
split above leaves out, the schedule has: the thread's order (reads issued during backward first),
the NVMe reads and writes both sides share, the commits held in unit order, and the links shared
with the parameters' and gradients' copies. So `auto` takes, of this split, every unit on the CPU
and every unit on the device, the one whose whole step the schedule predicts shortest
(planner.py's `_step_on`): right under either model of the engine (in parallel on a CUDA device,
in turn on the CPU's cores), and the plan predicts the engine as it runs. On a CUDA node the
split usually wins now (tests/test_step_on.py).

Without a CUDA device (the "device" is the CPU) `auto` keeps every unit on the CPU: the device
path would run torch ops on the very cores the native kernel uses, after copying the state into
buffers of its own, so it cannot finish earlier; `device` still runs it there (CI tests that
path on the CPU).

[Note: the device step's staging memory]
A unit stepped on the device takes device memory for its staged state while it is in flight: the
engine's staging sets ([Note: device staging] in optim/device_staging.py), `DeviceStaging.SETS`
of them, each `DeviceStaging.set_bytes` of the device-stepped units: per state key the largest
unit's buffer as the store allocates it (`Sizes.state_units`: compact state's scales and
rounding included), the largest shard's low-precision output unless the parameters' device
home takes it in place (ParamStore.device_out: parameters on the device, one rank, ZeRO-0 or
ZeRO-3, where every unit's home holds exactly its shard), and its gradient where the engine stages it in: on a CUDA device
with the gradients off it (`staging_bytes_of`; a CPU "device" reads host gradients where they are).
The plan counts it as `needs["device_step"]["device"]`, the engine reserves the same buffers
from the device tier: one function, so the two cannot disagree.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..optim.device_staging import DeviceStaging
from ..optim.state_terms import OptStateSizing, UnitBytes
from ..state import Location
from ..tiers.homes import HOMES

STEP_ON = ("cpu", "device", "auto")  # optimizer.step_on's values (config.py's Literal)


def steps_on(requested: str, homes: Sequence[Location]) -> tuple[str, ...]:
    """Each unit's "cpu" / "device" for `optimizer.step_on = requested` ("auto": every host/NVMe
    unit on the CPU, the choice before the rates are weighed), given each unit's optimizer home in
    unit index order ([Note: where the update runs])."""
    if requested not in STEP_ON:
        raise ConfigError(f"optimizer.step_on: must be one of {', '.join(map(repr, STEP_ON))}, got {requested!r}")
    off_device = "device" if requested == "device" else "cpu"
    return tuple("device" if HOMES[home].on_device else off_device for home in homes)


def cpu_rate_key(rates: dict[str, float], rule, layout) -> str:
    """The CPU update's rate key (params/s) for the update rule (`rule.name`) and the state's dtypes:
    `cpu_<rule>_<master>_<moments>` where the node's rates have it (`zerotier bench adam` measures
    it), else `cpu_adam` (fp32 Adam)."""
    key = f"cpu_{rule.name}_{layout.master}_{layout.moments}"
    return key if key in rates else "cpu_adam"


def cpu_out_scale(state_bytes: float, grad_bytes: int, lp_bytes: int, bench_out_bytes: float) -> float:
    """[Note: the CPU rate's new parameters]: the CPU update's seconds per parameter writing the new
    parameters in `lp_bytes`, over those of the bench's call (writing `bench_out_bytes`: `out_bytes_at`)."""
    moved = 2 * state_bytes + grad_bytes
    return (moved + lp_bytes) / (moved + bench_out_bytes)


def out_bytes_at(rates: dict[str, float], master_bytes: int) -> float:
    """The new parameters' bytes per parameter in the bench's timed call: the master's itemsize, or
    none for rates timed without them (`cpu_params_out` 0)."""
    return master_bytes * rates.get("cpu_params_out", 1.0)


def device_rate_key(rates: dict[str, float], rule, layout) -> str:
    """The device update's rate key (bytes/s of the kernel's traffic, UpdateCosts.kernel_bytes):
    `device_<rule>_<master>_<moments>` where the node's rates have it (`zerotier bench step`
    measures it on a CUDA device), else `device_adam`."""
    key = f"device_{rule.name}_{layout.master}_{layout.moments}"
    return key if key in rates else "device_adam"


def shard_in_place(params_on_device: bool, world_size: int, stage: int) -> bool:
    """[Note: the new shard's way home] The device update writes each unit's new shard into its
    parameters' home: device memory holding exactly this rank's shard (ParamStore.device_out)."""
    return params_on_device and (world_size == 1 or stage in (0, 3))


def staging_bytes_of(unit_state: Sequence[UnitBytes], shards: Sequence[int], lp_itemsize: int,
                     grad_itemsize: int) -> Callable[[Sequence[int]], int]:
    """[Note: the device step's staging memory] The device bytes the engine's staging takes for the
    device-stepped units of the given indices: `unit_state` each unit's state buffers (key bytes, unit
    index order), `shards` its shard; `grad_itemsize` 0 where the update reads the gradients where they are."""
    def staging(indices: Sequence[int]) -> int:
        if not indices:
            return 0
        state_set = OptStateSizing.staging_set(unit_state[i] for i in indices)
        return DeviceStaging.SETS * DeviceStaging.set_bytes(state_set, max(shards[i] for i in indices),
                                                            lp_itemsize, grad_itemsize)
    return staging


@dataclass(frozen=True)
class UpdateCosts:
    """Seconds per parameter of a unit's shard on each side ([Note: choosing where each update runs])."""
    cpu: float
    device_in: float
    device_kernel: float
    device_out: float
    in_bytes: float      # bytes per parameter staged in, and out; the kernel's bytes per parameter (the
                         # device_in stage also carries the new shard's commit back to a device home)
    out_bytes: float
    kernel_bytes: float
    cpu_scale: float = 1.0  # [Note: the CPU rate's new parameters]: in `cpu`, the rate's scale by the bytes moved

    @classmethod
    def of(cls, rates: dict[str, float], state_bytes: float, grad_bytes: int, lp_bytes: int, *, cuda: bool,
           grads_on_device: bool, params_on_device: bool, params_in_place: bool | None = None,
           local_ranks: int = 1, master_bytes: int = 4,
           cpu_key: str = "cpu_adam", device_key: str = "device_adam") -> "UpdateCosts":
        """From the node's rates (`cpu_key`, `device_key`: the update's rate keys, `cpu_rate_key` /
        `device_rate_key`); off CUDA the links are memory copies (`mem_copy`) and the device's
        kernel runs on the CPU's cores (at `cpu_key`, the native kernel's rate: a bound).
        params_in_place: the update writes each new shard into its device home ([Note: the new shard's
        way home]: `shard_in_place`; None: wherever the parameters are on the device, as at one rank).
        master_bytes: the master's itemsize ([Note: the CPU rate's new parameters])."""
        in_place = params_on_device if params_in_place is None else params_in_place
        in_bytes = state_bytes + (0 if grads_on_device else grad_bytes)
        out_bytes = state_bytes + (0 if in_place else lp_bytes)
        home_bytes = lp_bytes if params_on_device and not in_place and cuda else 0  # the commit's copy back
        kernel_bytes = 2 * state_bytes + grad_bytes
        cpu_scale = cpu_out_scale(state_bytes, grad_bytes, lp_bytes, out_bytes_at(rates, master_bytes))
        cpu = local_ranks / rates[cpu_key] * cpu_scale
        link_in, link_out = ("h2d", "d2h") if cuda else ("mem_copy", "mem_copy")
        return cls(cpu=cpu, device_in=(in_bytes + home_bytes) / rates[link_in],
                   device_kernel=kernel_bytes / rates[device_key] if cuda else cpu,
                   device_out=out_bytes / rates[link_out], in_bytes=in_bytes, out_bytes=out_bytes,
                   kernel_bytes=kernel_bytes, cpu_scale=cpu_scale)

    @property
    def device_stage(self) -> float:
        """The pipeline's slowest stage per parameter."""
        return max(self.device_in, self.device_kernel, self.device_out)

    @property
    def device_fill(self) -> float:
        """The other two stages per parameter: the pipeline's fill and drain, paid on one unit."""
        return self.device_in + self.device_kernel + self.device_out - self.device_stage

    def device_s(self, params: int, largest: int) -> float:
        return self.device_stage * params + self.device_fill * largest if params else 0.0

    def cpu_s(self, params: int) -> float:
        return self.cpu * params


@dataclass(frozen=True)
class StepSplit:
    """Each unit's side, and what each side does with the units whose state is off the device."""
    units: tuple[str, ...]                      # "cpu" / "device" per unit, in unit index order
    sides: dict[str, tuple[int, int, float]]    # side -> (units, params of this rank, predicted seconds)
    staging_bytes: int                          # [Note: the device step's staging memory]


def choose(requested: str, homes: Sequence[Location], shards: Sequence[int], costs: UpdateCosts, cuda: bool,
           staging: Callable[[Sequence[int]], int]) -> StepSplit:
    """[Note: where the update runs] Each unit's side for `optimizer.step_on = requested`: forced,
    or split by the rates ("auto" with a CUDA device: [Note: choosing where each update runs]).
    staging: the device bytes of the staging for the device-stepped units of given indices
    (`staging_bytes_of`)."""
    on = steps_on(requested, homes)  # checks `requested`; "auto" -> the CPU
    movable = [not HOMES[home].on_device for home in homes]
    if requested != "auto" or not cuda:
        return summary(on, shards, movable, costs, staging)
    side = list(on)
    cpu_params = dev_params = largest = 0
    for i in sorted((i for i in range(len(shards)) if movable[i]), key=lambda i: (-shards[i], i)):
        n = shards[i]
        on_cpu = max(costs.cpu_s(cpu_params + n), costs.device_s(dev_params, largest))
        on_dev = max(costs.cpu_s(cpu_params), costs.device_s(dev_params + n, max(largest, n)))
        if on_dev < on_cpu:
            side[i], dev_params, largest = "device", dev_params + n, max(largest, n)
        else:
            cpu_params += n
    return summary(tuple(side), shards, movable, costs, staging)


def summary(side: Sequence[str], shards: Sequence[int], movable: Sequence[bool], costs: UpdateCosts,
            staging: Callable[[Sequence[int]], int]) -> StepSplit:
    """The split's sides (the units whose state is off the device) and its staging memory."""
    on = {s: [n for n, at, m in zip(shards, side, movable) if at == s and m] for s in ("cpu", "device")}
    sides = {s: (len(ns), sum(ns), costs.cpu_s(sum(ns)) if s == "cpu" else costs.device_s(sum(ns), max(ns)))
             for s, ns in on.items() if ns}
    staged = [i for i, (at, m) in enumerate(zip(side, movable)) if at == "device" and m]
    return StepSplit(tuple(side), sides, staging(staged))
