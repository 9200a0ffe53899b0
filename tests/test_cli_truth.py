"""CLI output that says what is true at one rank (issue 26 item 7): no "over 1 ranks"."""
import pytest

from zerotier import cli


def test_plan_at_one_rank_says_nothing_is_sharded(capsys):
    assert cli.main(["plan", "--params", "100M", "--stage", "3", "--device", "8GiB", "--host", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "zerotier plan: 100.0M trainable parameters, ZeRO stage 3 on one rank: nothing to shard"
    assert "over 1 ranks" not in out
    assert cli.main(["plan", "--params", "100M", "--stage", "3", "--world-size", "4", "--device", "8GiB",
                     "--host", "8GiB"]) == 0
    assert ", ZeRO stage 3 over 4 ranks" in capsys.readouterr().out.splitlines()[0]


def test_a_plan_that_does_not_fit_at_one_rank_does_not_talk_of_ranks(capsys):
    assert cli.main(["plan", "--params", "7B", "--stage", "1", "--device", "1GiB", "--host", "1GiB",
                     "--nvme", "0"]) == 1
    err = capsys.readouterr().err
    assert "do not fit" in err and "rank" not in err


@pytest.mark.parametrize("args", [["--stage", "0"], []])
def test_plan_at_stage_0_on_one_rank_names_no_sharding(args, capsys):
    assert cli.main(["plan", "--params", "100M", "--device", "8GiB", "--host", "8GiB"] + args) == 0
    assert capsys.readouterr().out.splitlines()[0] == "zerotier plan: 100.0M trainable parameters"
