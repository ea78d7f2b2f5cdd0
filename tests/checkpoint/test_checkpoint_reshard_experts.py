"""Resharding keeps every expert's identity: with several experts per rank file, expert i of any set
and of the merged checkpoint is, bit for bit, expert i of the original (weights and optimizer state).

The chain 1 -> 4 -> 2 -> 1 -> 4 workers runs the tool's ``main(argv)`` in process, except one step
through the real ``python -m fairseq_moe_ext.checkpoint`` command line.
"""

import subprocess
import sys

import pytest
import torch

from fairseq_moe_ext.checkpoint import __main__ as tool
from support.inputs.fake_checkpoints import EXPERT_KEY, full_state
from support.launch.fairseq_helpers import fairseq_env

EXPERTS = 8


def eight_distinct_experts():
    """A 1-process checkpoint whose 8 experts (and their optimizer moments) all differ."""
    state = full_state(experts=EXPERTS)
    state["model"][EXPERT_KEY] = torch.arange(EXPERTS * 6, dtype=torch.float32).view(EXPERTS, 2, 3) + 0.25
    state["last_optimizer_state"]["state"][1]["exp_avg"] = torch.randn(EXPERTS, 2, 3)
    return state


def rank_files(base, world):
    return [torch.load(f"{base}-rank-{r}-of-{world}.pt", weights_only=False) for r in range(world)]


def assert_each_rank_file_holds_its_experts_in_order(base, world, original):
    per_rank = EXPERTS // world
    for rank, state in enumerate(rank_files(base, world)):
        held = slice(rank * per_rank, (rank + 1) * per_rank)
        assert torch.equal(state["model"][EXPERT_KEY], original["model"][EXPERT_KEY][held]), (world, rank)
        assert torch.equal(
            state["last_optimizer_state"]["state"][1]["exp_avg"],
            original["last_optimizer_state"]["state"][1]["exp_avg"][held],
        ), (world, rank)


@pytest.mark.slow
def test_resharding_8_experts_over_4_2_1_4_workers_keeps_every_expert_tensor(tmp_path):
    original = eight_distinct_experts()
    torch.save(original, tmp_path / "one.pt")
    steps = [(4, "in process"), (2, "in process"), (1, "command line"), (4, "in process")]
    source = tmp_path / "one.pt"
    for step, (world, how) in enumerate(steps):
        (tmp_path / f"step{step}").mkdir()
        target = tmp_path / f"step{step}" / "ck.pt"
        argv = ["reshard", str(source), str(target), "--world-size", str(world)]
        if how == "in process":
            assert tool.main(argv) == 0
        else:
            subprocess.run(
                [sys.executable, "-m", "fairseq_moe_ext.checkpoint", *argv],
                check=True,
                env=fairseq_env(),
                capture_output=True,
            )
        assert_each_rank_file_holds_its_experts_in_order(str(target)[: -len(".pt")], world, original)
        source = target

    assert tool.main(["merge", str(source), str(tmp_path / "merged.pt")]) == 0
    merged = torch.load(tmp_path / "merged.pt", weights_only=False)
    assert merged["model"].keys() == original["model"].keys()
    for key, want in original["model"].items():
        assert torch.equal(merged["model"][key], want), key
    for i in range(EXPERTS):
        assert torch.equal(merged["model"][EXPERT_KEY][i], original["model"][EXPERT_KEY][i]), f"expert {i}"
        assert torch.equal(
            merged["last_optimizer_state"]["state"][1]["exp_avg"][i],
            original["last_optimizer_state"]["state"][1]["exp_avg"][i],
        ), f"expert {i} optimizer"
    assert torch.equal(
        merged["last_optimizer_state"]["state"][0]["exp_avg"], original["last_optimizer_state"]["state"][0]["exp_avg"]
    )
