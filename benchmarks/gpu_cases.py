"""bench_gpu.py's cases at run time: what each framework needs, and how its step is built.

The cases themselves (names, settings, each zerotier case's config) are gpu_case_list.py's.

Model building ([Note: the same weights everywhere] in gpu_model.py): zerotier cases build on the
meta device and materialize unit by unit into their tiers (init_fn); DeepSpeed stage 3 builds
under deepspeed.zero.Init and fills one gathered parameter at a time; the others (whose method
holds the fp32 model on the device) build there directly. No case holds a second full copy.
"""
from __future__ import annotations

import os
import shutil
import time

import gpu_model as gm
from gpu_case_list import CASES, HPARAMS, zerotier_config

PEER_MODULE = {"deepspeed": "deepspeed", "torchao": "torchao"}
GiB = 1 << 30


class NotApplicable(Exception):
    """The case cannot run here; the message says why (the row reads n/a (message))."""


def peer_needs(framework: str, settings: dict, size: str) -> dict[str, tuple[int, str]]:
    """Rough bytes a peer needs per tier (device, host, nvme) and what they are: the n/a row's
    figures when they do not fit, so a 13B run does not spend minutes finding out."""
    numel, act = gm.param_count(size), gm.activation_bytes(size)
    if framework == "torch":
        return {"device": (16 * numel + act, "fp32 params, grads and Adam moments + activations")}
    if framework == "torchao":
        grads = 0 if settings["offload_gradients"] else 4 * numel
        return {"device": (4 * numel + 2 * numel + grads + act,
                           "fp32 params, their bf16 autocast copies" + ("" if grads else ", fp32 grads")
                           + " + activations"),
                "host": (12 * numel + 4 * numel, "fp32 params, Adam moments and grads")}
    if settings["stage"] == 2:  # bf16 params and grads stay on the device
        need = {"device": (4 * numel + act, "bf16 params and grads + activations")}
        state = (16 * numel, "fp32 master, moments and grads")
    else:
        need = {"device": (act, "activations + prefetched params")}
        state = (18 * numel, "fp32 master, moments and grads + bf16 params")
    need["host" if settings["offload_optimizer"] == "cpu" else "nvme"] = state
    return need


def capacities(device, nvme_path: str) -> dict[str, int | None]:
    """What this machine has per tier: device memory, RAM, free disk (None: no such tier here)."""
    import torch
    return {"device": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
            "host": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "nvme": shutil.disk_usage(nvme_path).free}


def refuse_peer_that_cannot_fit(framework: str, settings: dict, size: str, have: dict) -> None:
    for tier, (nbytes, what) in peer_needs(framework, settings, size).items():
        if have.get(tier) is not None and nbytes > 0.9 * have[tier]:
            raise NotApplicable(f"does not fit: needs ~{nbytes / GiB:.0f} GiB on {tier} ({what}), "
                                f"{have[tier] / GiB:.0f} GiB here; needs per tier: " +
                                ", ".join(f"{t} {b / GiB:.0f} GiB" for t, (b, _) in
                                          peer_needs(framework, settings, size).items()))


def refuse_unsupported(case: str, clip: float | None, accum: int) -> None:
    """What a case cannot do with these settings: refused, not run without it."""
    framework, settings = CASES[case]
    if framework == "torchao" and clip is not None:
        raise NotApplicable("CPUOffloadOptimizer copies gradients to the host during backward: "
                            "clipping them afterwards is not supported (run with --clip none)")
    if settings.get("offload_gradients") and accum > 1:
        raise NotApplicable("offload_gradients=True does not accumulate gradients (--accum 1)")
    if settings.get("overlap") == "early" and clip is not None:
        raise NotApplicable("train.overlap = 'early' steps each unit before the window's norm is known: "
                            "it runs without clipping (--clip none)")


def deepspeed_config(settings: dict, args, largest: int) -> dict:
    s = gm.SIZES[args.size]
    zero = {"stage": settings["stage"], "contiguous_gradients": True, "overlap_comm": True,
            "reduce_bucket_size": 5e8,
            "offload_optimizer": {"device": settings["offload_optimizer"], "pin_memory": True}}
    if settings.get("offload_param"):
        zero["offload_param"] = {"device": settings["offload_param"], "pin_memory": True}
        if settings["offload_param"] == "nvme":
            zero["offload_param"].update(nvme_path=args.nvme_path, buffer_count=5, buffer_size=max(int(1e8), largest))
    if settings["offload_optimizer"] == "nvme":
        zero["offload_optimizer"].update(nvme_path=args.nvme_path, buffer_count=4)
    if settings.get("zenflow"):  # deepspeed.ai/tutorials/zenflow's settings
        zero["zenflow"] = {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto",
                           "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True}
    beta1, beta2 = HPARAMS["betas"]
    return {
        "train_micro_batch_size_per_gpu": s["batch"], "gradient_accumulation_steps": args.accum,
        "train_batch_size": s["batch"] * args.accum,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": HPARAMS["lr"], "betas": [beta1, beta2],
                                                  "eps": HPARAMS["eps"], "weight_decay": HPARAMS["weight_decay"]}},
        "zero_optimization": zero,
        "gradient_clipping": args.clip or 0.0,
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }


def _largest_param(size: str) -> int:
    s = gm.SIZES[size]
    return max(s["vocab"] * s["dim"], s["dim"] * s["ffn"])


def setup(case: str, args, device, out: dict):
    """Build the model and the case's training step. Returns (step(micro_batches) -> loss, close, engine).
    out gets the case's plan and prediction (zerotier) as side results."""
    import torch
    framework, settings = CASES[case]
    refuse_unsupported(case, args.clip, args.accum)
    gen = gm.init_device(args.tiny)
    to_dev = lambda t: t.to(device, non_blocking=True)  # noqa: E731

    if framework == "zerotier":
        return _zerotier(case, args, device, gen, out, to_dev)
    refuse_peer_that_cannot_fit(framework, settings, args.size, capacities(device, args.nvme_path))

    if framework == "deepspeed":
        return _deepspeed(settings, args, device, gen, to_dev)
    model = gm.build(args.size, device, gen)
    params = list(model.parameters())
    if framework == "torch":
        opt = torch.optim.AdamW(params, **HPARAMS, fused=True)
        return _autocast_step(model, params, opt, args, device, to_dev), lambda: None, None
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        from torchao.prototype.low_bit_optim import CPUOffloadOptimizer
    opt = CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=settings["offload_gradients"],
                              fused=True, **HPARAMS)
    return _autocast_step(model, params, opt, args, device, to_dev), lambda: None, None


def _zerotier(case, args, device, gen, out, to_dev):
    import zerotier
    from predict_table import predict_here
    from zerotier.planner.messages import PlanDoesNotFit
    cfg = zerotier_config(case, args.nvme_path, args.threads, args.clip, args.accum, str(device))
    pred = predict_here(args.size, case, cfg, device)  # before any byte moves: a plan that cannot fit is n/a
    out["predicted"] = pred
    if not pred["fits"]:
        raise NotApplicable(f"does not fit: {pred['reason']}")
    model = gm.llama(args.size, "meta")
    init_fn, weights_s = gm.zerotier_init_fn(model, gen), [0.0]

    def timed_init_fn(module):  # set-up's split (issue 36 item 6): drawing the weights vs the rest
        t0 = time.perf_counter()
        init_fn(module)  # ends in a copy to the unit's CPU tensor: synchronous
        weights_s[0] += time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        engine = zerotier.initialize(model, cfg, init_fn=timed_init_fn)
    except PlanDoesNotFit as exc:  # the engine's own plan (this node's rates, no compute) may place `auto` otherwise
        raise NotApplicable(f"does not fit (the engine's plan): {str(exc).splitlines()[0]}") from None
    out["setup_split_s"] = {"initialize": time.perf_counter() - t0, "of which drawing weights": weights_s[0],
                            # [Note: initialize's phases]; the pool's cudaHostRegister time (bench_setup.py)
                            "phases": {k: v["seconds"] for k, v in engine._placement.times.summary().items()},
                            "pinning": engine.host_pool.stats()["pin_ns"] / 1e9}
    out["plan"] = {"need": dict(engine.plan.need), "predicted_step_s": engine.plan.predicted_step_s,
                   "rates_measured": engine.plan.rates_measured,
                   "placement": {k: v.value for k, v in engine.plan.placement.items()},
                   "optimizer_split": {t: b for t, (b, _) in engine.plan.optimizer_split.items()} or None}

    def zt_step(micro):
        total = 0.0
        for x, y in micro:
            loss = engine(to_dev(x), to_dev(y))
            engine.backward(loss)
            total += loss.detach().float()
        engine.step()
        return total / len(micro)
    return zt_step, engine.close, engine


def _deepspeed(settings, args, device, gen, to_dev):
    import deepspeed
    if "nvme" in (settings["offload_optimizer"], settings.get("offload_param")):
        from deepspeed.accelerator import get_accelerator
        if not get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=True):
            raise NotApplicable("DeepSpeed's async_io op cannot build here: libaio's headers or .so not found "
                                "(gpu_wheels.sh carries them in wheels/libaio; gpu_run.sh sets CFLAGS/LDFLAGS)")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    if settings.get("zenflow") and "zenflow" not in DeepSpeedZeroConfig.model_fields:
        raise NotApplicable(f"DeepSpeed {deepspeed.__version__} has no ZenFlow (zero_optimization.zenflow)")
    config = deepspeed_config(settings, args, _largest_param(args.size))
    if settings["stage"] == 3:  # partitioned as it is built: never a whole model on one tier
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device=settings.get("offload_param"),
                                 pin_memory=True):
            model = gm.llama(args.size, device)
        gm.deepspeed_init(model, gen)
    else:
        model = gm.build(args.size, device, gen)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)

    def ds_step(micro):
        total = 0.0
        for x, y in micro:
            loss = engine(to_dev(x), to_dev(y))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        return total / len(micro)
    return ds_step, lambda: None, None


def _autocast_step(model, params, opt, args, device, to_dev):
    import torch

    def step(micro):
        total = 0.0
        for x, y in micro:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(to_dev(x), to_dev(y))
            (loss / len(micro)).backward()
            total += loss.detach().float()
        if args.clip is not None:
            torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / len(micro)
    return step
