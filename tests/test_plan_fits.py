"""Plans that fit, run (issue 15 item 5): with every tier's budget set to exactly what the plan
says it needs, training runs — the planner and the stores share one accounting (nesting, each
block's and file's rounding, NVMe rewrites in flight, the prefetch window)."""
from __future__ import annotations

import json

import pytest
import torch

import zerotier
from zerotier.models import TinyGPT, batches

from reference_runs import PLACEMENTS


class Nested(torch.nn.Module):
    """8 modules nested in each other, each owning a parameter (hostile trial #16)."""

    def __init__(self, depth=8):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.inner = Nested(depth - 1) if depth > 1 else None

    def forward(self, x):
        x = torch.tanh(x @ self.w)
        return self.inner(x) if self.inner is not None else x


class NestedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Nested(4) for _ in range(3))

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return (x - y).square().mean()


def tiny_gpt():
    return TinyGPT(vocab=64, dim=32, layers=3, heads=2, seq=16)


def data(name):
    if name == "gpt":
        return list(batches(64, 16, 2, 3))
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)) for _ in range(3)]


MODELS = {"gpt": tiny_gpt, "nested": NestedModel, "nested-each-module": NestedModel}
WRAP = {"nested-each-module": ["Nested"]}  # every nesting level its own unit


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.pins("design#plans-that-fit-run")
def test_budgets_at_exactly_the_plans_need_train(name, placement, tmp_path):
    cfg = {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)},
           "train": {"max_grad_norm": 1.0, "wrap": WRAP.get(name, "auto")}, "prefetch": {"lookahead": 2}}
    torch.manual_seed(0)
    with zerotier.initialize(MODELS[name](), cfg) as engine:
        need = dict(engine.plan.need)
    cfg["tiers"].update({tier: max(need[tier], 1) for tier in ("device", "host")})
    if need["nvme"]:
        cfg["tiers"]["nvme"] = need["nvme"]
    torch.manual_seed(0)
    with zerotier.initialize(MODELS[name](), cfg) as engine:
        for x, y in data("gpt" if name == "gpt" else "nested"):
            engine.backward(engine(x, y))
            engine.step()
        assert engine.global_steps == 3


# --- [Note: the plan against the machine] (issue 35 item 3) ----------------------------------------------
GiB = 1 << 30


def _small_machine(monkeypatch, total):
    from zerotier.planner import machine_fit
    from zerotier.envinfo import UsableMemory

    monkeypatch.setattr(machine_fit, "usable_memory", lambda: UsableMemory(total, total // 2, None, ""))


def test_a_plan_over_this_machines_ram_fits_the_budgets_not_the_machine(monkeypatch, capsys):
    """A 200 GiB host budget on a 23.5 GiB machine: the plan's RAM need is checked against the machine."""
    from zerotier import cli

    _small_machine(monkeypatch, int(23.5 * GiB))
    args = ["plan", "--params", "3B", "--device", "1GiB", "--host", "200GiB", "--nvme", "0"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "fits: yes" not in out
    assert "fits the budgets, not the machine: needs " in out and "of RAM, this machine has 23.50 GiB" in out
    _small_machine(monkeypatch, 2000 * GiB)
    assert cli.main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["machine_note"] is None


def test_initialize_refuses_a_plan_over_this_machines_ram(monkeypatch):
    from zerotier.errors import BudgetError

    _small_machine(monkeypatch, 100 << 20)  # below RSS_OUTSIDE_BUDGETS alone
    with pytest.raises(BudgetError, match=r"^the plan fits the budgets, not this machine: it needs [\d.]+ MiB of "
                                          r"RAM, this machine has 100.00 MiB\. Lower tiers.host"):
        zerotier.initialize(tiny_gpt(), {"tiers": {"device": "64MiB", "host": "64MiB"}})


def test_another_nodes_plan_is_checked_against_that_nodes_recorded_memory(monkeypatch, tmp_path, capsys):
    """--rates FILE: the check uses the RAM `zerotier bench` recorded there, not this machine's."""
    from zerotier import cli
    from zerotier.bench import save
    from zerotier.measure import bench_memory

    assert bench_memory(1 << 20, repeat=1)["total_bytes"] > 0  # bench records the node's RAM
    there = tmp_path / "other.json"
    save({"mem": {"copy_GBps": 8.0, "inplace_GBps": 8.0, "total_bytes": 16 * GiB},
          "adam": {"fp32_params_per_s": 1e9}}, there)
    _small_machine(monkeypatch, 2000 * GiB)
    assert cli.main(["plan", "--params", "3B", "--device", "1GiB", "--host", "200GiB", "--nvme", "0",
                     "--rates", str(there)]) == 0
    assert "not the machine: needs " in (out := capsys.readouterr().out) and f"the node of {there} has 16.00 GiB" in out
