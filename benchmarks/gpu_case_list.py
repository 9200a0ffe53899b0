"""bench_gpu.py's cases: each one's framework and settings, and the engine config of a zerotier case.

Read by gpu_cases.py (which builds each case's step), predict_table.py (which plans the zerotier
cases before any GPU run), bench_gpu.py and gpu_table.py; it imports none of them.

Cases (name -> framework, settings); their order is their priority under --time-limit:
  torch                  plain torch, fp32 params under bf16 autocast, AdamW(fused=True), all on the GPU
  zt-opt-host            zerotier exact: optimizer on host (params on device, gradients on host)
  ds-z2-offload          DeepSpeed ZeRO-Offload stage 2: offload_optimizer cpu, pinned, DeepSpeedCPUAdam
  zt-opt-host-early      zt-opt-host with train.overlap = "early" (Adam during the last backward)
  zt-opt-host-spec       zt-opt-host with train.overlap = "speculative" (issue 25)
  zt-opt-host-delayed    zt-opt-host with train.overlap = "delayed" (ZeRO-Offload's DPU: not the same training)
  torchao-offload-grads  torchao CPUOffloadOptimizer(AdamW, fused), offload_gradients=True
  zt-params-host         zerotier exact: params + optimizer on host
  zt-opt-split           zerotier exact: optimizer split 60 % host, 40 % NVMe (unit by unit)
  zt-compact-host        zerotier compact (bf16 master + int8 moments): optimizer on host
  zt-compact-auto        compact, every kind `auto`: the planner's placement (the 20B case)
  zt-compact-nvme        compact, params, gradients and optimizer on NVMe
  ds-z3-offload          DeepSpeed stage 3 under deepspeed.zero.Init: params + optimizer on cpu, pinned
  torchao-offload        the same as torchao-offload-grads with offload_gradients=False
  ds-zenflow             DeepSpeed ZenFlow over ZeRO-Offload stage 2 (DeepSpeed >= 0.17)
  zt-opt-nvme            zerotier exact: optimizer on NVMe (params on device, gradients on host)
  zt-params-nvme         zerotier exact: params + optimizer on NVMe
  ds-infinity            DeepSpeed ZeRO-Infinity under zero.Init: params + optimizer on nvme (async_io)
  zt-opt-host-on-S       zerotier exact, optimizer on host, optimizer.step_on = S (cpu / device / auto:
                         where each unit's update runs, issue 34); the default overlap
  zt-compact-host-on-S   the same, compact state
  zt-compact-auto-on-S   zt-compact-auto with optimizer.step_on = S (20B: compact on host does not fit a node)
"""
from __future__ import annotations

EXACT_HOST = {"params": "device", "gradients": "host", "optimizer": "host"}
COMPACT = {"master_dtype": "bf16", "moment_dtype": "int8"}
ALL_NVME = {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}
STEP_ON = ("cpu", "device", "auto")  # optimizer.step_on's values (zerotier/planner/step_on.py)
CASES = {
    "torch": ("torch", {}),
    "zt-opt-host": ("zerotier", {"offload": EXACT_HOST, "overlap": "none"}),
    "ds-z2-offload": ("deepspeed", {"stage": 2, "offload_optimizer": "cpu"}),
    "zt-opt-host-early": ("zerotier", {"offload": EXACT_HOST, "overlap": "early"}),
    "zt-opt-host-spec": ("zerotier", {"offload": EXACT_HOST, "overlap": "speculative"}),
    "zt-opt-host-delayed": ("zerotier", {"offload": EXACT_HOST, "overlap": "delayed"}),
    "torchao-offload-grads": ("torchao", {"offload_gradients": True}),
    "zt-params-host": ("zerotier", {"offload": {"params": "host", "gradients": "host", "optimizer": "host"}}),
    "zt-opt-split": ("zerotier", {"offload": {**EXACT_HOST, "optimizer": {"host": 0.6, "nvme": 0.4}}}),
    "zt-compact-host": ("zerotier", {"offload": EXACT_HOST, "precision": COMPACT}),
    "zt-compact-auto": ("zerotier", {"offload": {"params": "auto", "gradients": "auto", "optimizer": "auto"},
                                     "precision": COMPACT}),
    "zt-compact-nvme": ("zerotier", {"offload": ALL_NVME, "precision": COMPACT}),
    "ds-z3-offload": ("deepspeed", {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}),
    "torchao-offload": ("torchao", {"offload_gradients": False}),
    "ds-zenflow": ("deepspeed", {"stage": 2, "offload_optimizer": "cpu", "zenflow": True}),
    "zt-opt-nvme": ("zerotier", {"offload": {**EXACT_HOST, "optimizer": "nvme"}}),
    "zt-params-nvme": ("zerotier", {"offload": {"params": "nvme", "gradients": "host", "optimizer": "nvme"}}),
    "ds-infinity": ("deepspeed", {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}),
    **{f"zt-opt-host-on-{s}": ("zerotier", {"offload": EXACT_HOST, "step_on": s}) for s in STEP_ON},
    **{f"zt-compact-host-on-{s}": ("zerotier", {"offload": EXACT_HOST, "precision": COMPACT, "step_on": s})
       for s in STEP_ON},
    **{f"zt-compact-auto-on-{s}": ("zerotier", {"offload": {"params": "auto", "gradients": "auto", "optimizer": "auto"},
                                                "precision": COMPACT, "step_on": s}) for s in STEP_ON},
}
ZEROTIER_CASES = [c for c, (fw, _) in CASES.items() if fw == "zerotier"]
HPARAMS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def zerotier_config(case: str, nvme_path: str | None, threads: int, clip: float | None, accum: int,
                    device: str) -> dict:
    """The engine config of a zerotier case (also what predict_table.py plans)."""
    settings = CASES[case][1]
    return {
        "offload": settings["offload"],
        "tiers": {"nvme_path": nvme_path},
        "precision": {"param_dtype": "bf16", **settings.get("precision", {})},
        "optimizer": {**HPARAMS, "betas": list(HPARAMS["betas"]), "threads": threads,
                      **({"step_on": settings["step_on"]} if "step_on" in settings else {})},
        "train": {"max_grad_norm": clip, "grad_accum_steps": accum,
                  "overlap": settings.get("overlap", "auto"),
                  "handle_signals": False, "device": device},
        "profile": {"enabled": True},
    }
