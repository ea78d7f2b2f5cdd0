"""Shared experts, the sigmoid router and loss-free bias balancing together, through the real
command-line tools: fairseq-train on 2 torchrun workers, resumed bit-exactly, the bias reported by
``inspect``, and the set loaded by fairseq-generate in one process."""

import pytest
import torch

from support.launch.fairseq_helpers import (
    USER_DIR,
    json_logs,
    preprocess_parallel,
    run_checkpoint_tool,
    run_fairseq,
    torchrun,
    write_parallel_corpus,
)
from support.launch.multiworker_cli_runs import moe_args
from support.launch.paths import PROBES
from support.probes.full_precision_logs import carries_every_digit

pytestmark = pytest.mark.slow
TRAIN_EVERY_DIGIT = PROBES / "fairseq_train_every_digit.py"
# fmt: off
FLAGS = ["--moe-shared-expert-count", "2", "--moe-router", "sigmoid", "--moe-balance", "bias",
         "--moe-bias-update-rate", "0.01", "--moe-gate-loss-wt", "0"]
# fmt: on


def train_args(data, save_dir, max_update, *extra):
    # moe_args without clipping (fairseq's default --clip-norm is 0), with the routing flags, no validation.
    return moe_args(data, save_dir, max_update, *FLAGS, "--clip-norm", "0", "--disable-validation", *extra)


def biases(path):
    model = torch.load(path, weights_only=False)["model"]
    return {k: v for k, v in model.items() if k.endswith(".balance_bias.bias")}


def test_two_workers_with_shared_experts_sigmoid_and_bias_resume_exactly_and_generate(tmp_path):
    data = preprocess_parallel(write_parallel_corpus(tmp_path / "raw"), tmp_path / "bin")
    # Saved at update 4 (mid-epoch) on the way to 8; a second run resumes from that set.
    full = torchrun(2, TRAIN_EVERY_DIGIT, train_args(data, tmp_path / "full", 8, "--save-interval-updates", "4"))
    at4 = tmp_path / "full" / "checkpoint_1_4.pt"
    resumed = torchrun(2, TRAIN_EVERY_DIGIT, train_args(data, tmp_path / "ck", 8, "--restore-file", str(at4)))

    want = {int(r["num_updates"]): float(r["loss"]) for r in json_logs(full)}
    got = {int(r["num_updates"]): float(r["loss"]) for r in json_logs(resumed)}
    assert sorted(got) == [5, 6, 7, 8] and carries_every_digit(got.values())
    assert all(got[u] == want[u] for u in got), (got, want)
    final = biases(tmp_path / "full" / "checkpoint_last-rank-0-of-2.pt")
    assert len(final) == 2 and all(b.abs().max() > 0 for b in final.values()), "the bias moved in training"
    assert all(torch.equal(b, biases(tmp_path / "ck" / "checkpoint_last-rank-0-of-2.pt")[k]) for k, b in final.items())
    # Stored once: rank 1's file holds its experts only, no bias and no shared expert.
    rank1 = torch.load(tmp_path / "full" / "checkpoint_last-rank-1-of-2.pt", weights_only=False)["model"]
    assert not [k for k in rank1 if "balance_bias" in k or "shared_experts" in k]

    report = run_checkpoint_tool("inspect", tmp_path / "full" / "checkpoint_last.pt", check=True).stdout
    key = "decoder.layers.1.fc1.router.balance_bias.bias"
    shown = ", ".join(f"{v:+.4f}" for v in final[key].tolist())
    assert f"  {key}: balance bias (--moe-balance bias) [{shown}]" in report, report
    assert "VERDICT PROBLEM" not in report, report

    generated = run_fairseq(
        "generate",
        str(data),
        "--user-dir",
        USER_DIR,
        "--path",
        str(tmp_path / "full" / "checkpoint_last.pt"),
        "--cpu",
        "--beam",
        "2",
        "--max-tokens",
        "2000",
        "--num-workers",
        "0",
    )
    assert "BLEU" in generated
