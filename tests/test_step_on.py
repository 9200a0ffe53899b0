"""Where each unit's optimizer update runs ([Note: where the update runs] in planner/step_on.py):
`optimizer.step_on` -> `Plan.optimizer_step_on`, one "cpu" / "device" per trainable unit."""
import pytest
import torch

from zerotier.config import OffloadConfig, PrecisionConfig, PrefetchConfig, TiersConfig
from zerotier.errors import ConfigError
from zerotier.planner.planner import make_plan
from zerotier.planner.predict import StepOptions
from zerotier.planner.step_on import steps_on
from zerotier.state import Location

CPU = torch.device("cpu")
BIG = 10**15


@pytest.fixture(autouse=True)
def _no_saved_rates(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTIER_BENCH_FILE", str(tmp_path / "no-bench.json"))


def plan(numels, optimizer, step_on):
    offload = OffloadConfig(params="host", gradients="host", optimizer=optimizer)
    return make_plan(numels, TiersConfig(), offload, PrecisionConfig(), PrefetchConfig(), CPU,
                     budgets={"device": BIG, "host": BIG, "nvme": BIG}, alignment=1,
                     step=StepOptions(step_on=step_on))


@pytest.mark.parametrize("optimizer", ["host", "nvme"])
@pytest.mark.parametrize("step_on, expect", [("cpu", "cpu"), ("device", "device"), ("auto", "cpu")])
def test_step_on_puts_every_host_or_nvme_unit_where_the_key_says(optimizer, step_on, expect):
    p = plan([3000, 2000, 1000], optimizer, step_on)
    assert p.optimizer_step_on == (expect,) * 3
    assert p.to_dict()["optimizer_step_on"] == [expect] * 3


@pytest.mark.parametrize("step_on", ["cpu", "device", "auto"])
def test_state_on_the_device_is_updated_there_whatever_the_key(step_on):
    assert plan([3000, 2000], "device", step_on).optimizer_step_on == ("device", "device")


def test_a_split_gives_each_unit_its_own_entry_in_unit_order():
    p = plan([1000] * 4, {"host": 0.5, "nvme": 0.5}, "device")
    assert p.optimizer_units == (Location.HOST,) * 2 + (Location.NVME,) * 2
    assert p.optimizer_step_on == ("device",) * 4
    assert steps_on("cpu", (Location.DEVICE, Location.HOST, Location.NVME)) == ("device", "cpu", "cpu")


def test_an_unknown_step_on_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match=r"optimizer\.step_on: must be one of 'cpu', 'device', 'auto', got 'gpu'"):
        steps_on("gpu", (Location.HOST,))
