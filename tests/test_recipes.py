"""The recipes in examples/ (examples/README.md), each run at its CI size (--tiny: a 2-layer Llama
built from a transformers config and saved to a temporary directory, 3 optimizer steps, budgets
"auto"), in this process. Each names the node it was written for and its command."""
from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="pip install transformers (part of .[test])")
pytest.importorskip("peft", reason="pip install peft (part of .[test])")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, *argv: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        namespace = runpy.run_path(str(EXAMPLES / script), run_name="recipe")
        return namespace["main"](list(argv))
    finally:
        sys.path.remove(str(EXAMPLES))


def trained(result, steps=3):
    assert result["steps"] == steps
    losses = result.get("losses") or [result["loss"]]
    assert all(math.isfinite(x) and 0 < x < 10 for x in losses), losses


def check_finetune_exact(result):
    trained(result)
    cfg = result["cfg"]
    assert (cfg.offload.optimizer, cfg.precision.master_dtype, cfg.precision.moment_dtype) == ("host", "fp32", "fp32")


def check_finetune_compact(result):
    trained(result)
    assert (result["cfg"].precision.master_dtype, result["cfg"].precision.moment_dtype) == ("bf16", "int8")


def check_lora(result):
    trained(result)
    assert result["cfg"].offload.params == "nvme" and result["frozen"] > 0


def check_deepspeed(result):
    trained(result)
    cfg = result["cfg"]
    assert (cfg.zero.stage, cfg.offload.params, cfg.offload.optimizer, cfg.train.grad_accum_steps) == (3, "host", "nvme", 4)
    assert (cfg.optimizer.lr, cfg.optimizer.betas) == (1e-5, (0.9, 0.95))


def check_hf_trainer(result):
    trained(result)
    cfg = result["cfg"]
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.precision.param_dtype) == (2e-5, 0.1, "bf16")  # "auto" filled


def check_trl_sft(result):
    trained(result)
    assert result["frozen"] > 0 and result["cfg"].optimizer.lr == 2e-4  # LoRA on the streamed base; SFTConfig's lr


def check_plan_fix(result):
    assert (result["refused"], result["fixed"]) == (1, 0)


RECIPES = {
    "finetune_7b_exact": ("finetune_full.py", [], check_finetune_exact),
    "finetune_20b_compact": ("finetune_full.py", ["--config", str(EXAMPLES / "finetune_20b_compact.toml")],
                             check_finetune_compact),
    "lora_nvme": ("lora_nvme.py", [], check_lora),
    "deepspeed_migrate": ("deepspeed_migrate.py", [], check_deepspeed),
    "hf_trainer": ("hf_trainer.py", [], check_hf_trainer),
    "trl_sft": ("trl_sft.py", [], check_trl_sft),
    "plan_fix": ("plan_fix.py", [], check_plan_fix),
}


@pytest.mark.filterwarnings("ignore:.* is deprecated and will be removed in v6:FutureWarning")  # transformers 5 renames
@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_runs_at_its_ci_size(name, tmp_path):
    script, argv, check = RECIPES[name]
    doc = (EXAMPLES / script).read_text()
    assert "Written for:" in doc and f"python examples/{script}" in doc  # the node and the command
    tiny = [] if name == "plan_fix" else ["--tiny", "--workdir", str(tmp_path)]
    check(run(script, *tiny, *argv))
    if tiny:  # the engine's checkpoint, for `zerotier export` or a resume
        assert any((tmp_path / "checkpoint").iterdir())


def test_every_recipe_is_listed_in_the_examples_readme():
    readme = (EXAMPLES / "README.md").read_text()
    for script, argv, _ in RECIPES.values():
        assert f"examples/{script}" in readme, script
        for arg in argv:
            assert Path(arg).name in readme, arg
