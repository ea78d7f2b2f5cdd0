"""--moe-freeze through fairseq-train: a run resumed with its router frozen keeps the router bit for bit, says
why its balance losses are only logged, and carries the optimizer state of everything else over (the in-process
checks on every backend: tests/fairseq/test_freeze_and_balance_scope_steps.py)."""

import re

import pytest
import torch

from support.launch.fairseq_helpers import run_fairseq
from support.launch.multiworker_cli_runs import moe_args

pytestmark = pytest.mark.slow


def model_state(save_dir):
    (path,) = [p for p in save_dir.glob("checkpoint_last*.pt")]
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def test_a_run_resumed_with_the_router_frozen_keeps_it_bit_for_bit_and_trains_the_rest(data, tmp_path):
    save_dir = tmp_path / "ck"
    run_fairseq("train", *moe_args(data, save_dir, 2, "--no-epoch-checkpoints"), timeout=240)
    before = model_state(save_dir)
    output = run_fairseq(
        "train", *moe_args(data, save_dir, 4, "--no-epoch-checkpoints", "--moe-freeze", "router"), timeout=240
    )
    after = model_state(save_dir)
    routers = [name for name in before if ".router." in name]
    assert routers and all(torch.equal(before[n], after[n]) for n in routers)
    assert all(not torch.equal(before[n], after[n]) for n in before if n.endswith("fc1.experts.fc1_weight"))
    assert "was trained with --moe-freeze unset and this run has --moe-freeze router" in output
    resumed = [line for line in output.splitlines() if "resuming: " in line]
    assert any(
        re.search(r"this run freezes router: the optimizer keeps the state of the \d+ tensors", x) for x in resumed
    ), resumed
    assert "--moe-freeze router: the balance loss and z-loss are logged but not added to the loss" in output
    assert re.search(r'"moe_aux_loss": "0"', output) and re.search(r"num_updates 4\b|\"num_updates\": \"4\"", output)
