"""ZEROTIER_CHECK_PLAN=1: each component's peak in the tiers against its term in the plan
([Note: the plan against the run's peaks] in zerotier/planner/plan_check.py, [Note: peaks per
component] in zerotier/tiers/base.py)."""
from __future__ import annotations

import pytest
import torch

import zerotier
from zerotier.planner import planner as planner_module
from zerotier.planner.plan_check import PlanTermExceeded

CASES = {"optimizer-host": {"optimizer": "host"}, "optimizer-nvme": {"optimizer": "nvme", "gradients": "host"},
         "params-nvme": {"params": "nvme", "optimizer": "nvme"},
         "all-nvme": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])


def _cfg(tmp_path, offload):
    return {"tiers": {"device": "64MiB", "host": "256MiB", "nvme": "1GiB", "nvme_path": str(tmp_path)},
            "offload": offload}


def _train(engine, steps=2):
    for _ in range(steps):
        engine.backward(engine.module(torch.randn(8, 64)).square().mean())
        engine.step()


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_component_stays_within_its_term(tmp_path, monkeypatch, case):
    monkeypatch.setenv("ZEROTIER_CHECK_PLAN", "1")
    with zerotier.initialize(_model(), _cfg(tmp_path, CASES[case])) as engine:
        _train(engine)
        plan = engine.plan
        assert plan.need == {t: sum(term[t] for term in plan.needs.values()) for t in plan.need}
        peaks = {"device": engine.device_tier.component_peaks(), "host": engine.host_pool.component_peaks()}
        if engine.store is not None:  # the files, with their rewrites in flight
            peaks["nvme"] = engine.store.component_peaks()
        assert ("nvme" in peaks) == ("nvme" in case)
        for kind, where in plan.placement.items():  # every store was charged where its state lives
            if where.value in peaks:
                assert 0 < peaks[where.value][kind] <= plan.needs[kind][where.value], (kind, where)


def test_the_check_fails_when_a_term_is_understated(tmp_path, monkeypatch):
    """The optimizer's host term understated by half: the first step names it, its term and its peak."""
    monkeypatch.setenv("ZEROTIER_CHECK_PLAN", "1")
    real = planner_module.bytes_for

    def understated(kind, loc, s):
        want = real(kind, loc, s)
        return {**want, "host": want["host"] // 2} if kind == "optimizer" else want
    monkeypatch.setattr(planner_module, "bytes_for", understated)
    with zerotier.initialize(_model(), _cfg(tmp_path, CASES["optimizer-host"])) as engine:
        term = engine.plan.needs["optimizer"]["host"]
        with pytest.raises(PlanTermExceeded, match=r"ZEROTIER_CHECK_PLAN=1: the optimizer held [\d,]+ B on the host "
                                                   rf"tier, above their planned term of {term:,} B") as ei:
            _train(engine, steps=1)
        assert (ei.value.component, ei.value.tier, ei.value.term) == ("optimizer", "host", term)
        assert ei.value.peak > term


@pytest.mark.parametrize("kind", ["optimizer", "params"])
def test_the_check_fails_when_an_nvme_term_is_understated(tmp_path, monkeypatch, kind):
    """A kind's NVMe term understated by half: the first step names it on the nvme tier."""
    monkeypatch.setenv("ZEROTIER_CHECK_PLAN", "1")
    real = planner_module.bytes_for

    def understated(k, loc, s):
        want = real(k, loc, s)
        return {**want, "nvme": want["nvme"] // 2} if k == kind else want
    monkeypatch.setattr(planner_module, "bytes_for", understated)
    with zerotier.initialize(_model(), _cfg(tmp_path, CASES["params-nvme"])) as engine:
        term = engine.plan.needs[kind]["nvme"]
        with pytest.raises(PlanTermExceeded, match=rf"ZEROTIER_CHECK_PLAN=1: the {kind} held [\d,]+ B on the nvme "
                                                   rf"tier, above their planned term of {term:,} B") as ei:
            _train(engine, steps=1)
        assert (ei.value.component, ei.value.tier, ei.value.term) == (kind, "nvme", term)
        assert ei.value.peak > term


def test_without_the_check_nothing_is_charged(tmp_path, monkeypatch):
    monkeypatch.delenv("ZEROTIER_CHECK_PLAN", raising=False)
    with zerotier.initialize(_model(), _cfg(tmp_path, CASES["optimizer-nvme"])) as engine:
        _train(engine, steps=1)
        assert engine.device_tier.component_peaks() == {} and engine.host_pool.component_peaks() == {}
        assert engine.store.component_peaks() == {}


def test_the_optimizers_device_term_includes_the_device_steps_staging():
    """[Note: the device step's staging memory]: the optimizer store allocates the staged state of the
    units it updates on the device, so its device peak is checked against its term + needs['device_step']."""
    from zerotier.planner.plan_check import check_peaks

    class Tier:
        def __init__(self, peaks):
            self.peaks = peaks

        def component_peaks(self):
            return self.peaks

    needs = {"optimizer": {"device": 0, "host": 1000}, "device_step": {"device": 600}}
    check_peaks(needs, device=Tier({"optimizer": 600}), host=Tier({"optimizer": 1000}))
    with pytest.raises(PlanTermExceeded, match=r"the optimizer held 601 B on the device tier, above their planned "
                                               r"term of 600 B") as ei:
        check_peaks(needs, device=Tier({"optimizer": 601}))
    assert (ei.value.component, ei.value.term) == ("optimizer", 600)
    with pytest.raises(PlanTermExceeded, match=r"the params held 600 B on the device tier"):  # not the params'
        check_peaks(needs, device=Tier({"params": 600}))
