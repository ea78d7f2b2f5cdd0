"""A set trained with ``--ddp-backend fully_sharded --bf16`` on 2 workers resumes under ``legacy_ddp --bf16``
on the same 2 workers with its optimizer state, and that run's set resumes under fully_sharded again, through
the real command line (torchrun workers, gloo). fairseq stopped both with its assertion traceback ("Optimizer
does not match ... MemoryEfficientFP16Optimizer vs FP16Optimizer"), although the user typed the same flag.
The exact carry (every optimizer tensor the saved one) is checked per pair in process:
tests/parallel/test_backend_precision_resume.py. A resume in another precision is refused in one line.
"""

import shutil

import pytest

from support.launch.fairseq_helpers import json_logs, torchrun
from support.launch.multiworker_cli_runs import moe_args
from support.launch.paths import PROBES

pytestmark = pytest.mark.slow
TRAIN_EVERY_DIGIT = PROBES / "fairseq_train_every_digit.py"
CARRIED = "takes its optimizer state over (--ddp-backend changed)"
# bf16 updates of the two backends from one state differ by rounding (measured at update 3: 7e-5 relative).
BF16_LOSS_REL = 1e-3


def train(data, save_dir, max_update, backend, *extra, expect_failure=False):
    args = moe_args(data, save_dir, max_update, "--no-epoch-checkpoints", "--ddp-backend", backend, *extra)
    return torchrun(2, TRAIN_EVERY_DIGIT, args, expect_failure=expect_failure)


def losses(output):
    return {int(r["num_updates"]): float(r["loss"]) for r in json_logs(output)}


@pytest.fixture(scope="module")
def runs(parallel_data, tmp_path_factory):
    """fully_sharded --bf16 to update 2 (``fs_at2``) and, uninterrupted, to update 4."""
    root = tmp_path_factory.mktemp("backend_resume_cli")
    train(parallel_data, root / "fs", 2, "fully_sharded", "--bf16")
    shutil.copytree(root / "fs", root / "fs_at2")
    uninterrupted = train(parallel_data, root / "fs_full", 4, "fully_sharded", "--bf16")
    return {"root": root, "data": parallel_data, "want": losses(uninterrupted)}


def test_a_fully_sharded_bf16_set_resumes_under_legacy_ddp_bf16_and_back_with_its_optimizer(runs, tmp_path):
    save_dir = tmp_path / "chain"
    shutil.copytree(runs["root"] / "fs_at2", save_dir)
    to_legacy = train(runs["data"], save_dir, 3, "legacy_ddp", "--bf16")
    assert f"MemoryEfficientFP16Optimizer; FP16Optimizer {CARRIED}" in to_legacy, to_legacy[-3000:]
    back = train(runs["data"], save_dir, 4, "fully_sharded", "--bf16")
    assert f"FP16Optimizer; MemoryEfficientFP16Optimizer {CARRIED}" in back, back[-3000:]
    got = {**losses(to_legacy), **losses(back)}
    assert sorted(got) == [3, 4], got
    for update, loss in got.items():
        assert loss == pytest.approx(runs["want"][update], rel=BF16_LOSS_REL), (update, got, runs["want"])


def test_a_bf16_set_resumed_in_fp32_is_refused_in_one_line_naming_reset_optimizer(runs, tmp_path):
    save_dir = tmp_path / "fp32"
    shutil.copytree(runs["root"] / "fs_at2", save_dir)
    refused = train(runs["data"], save_dir, 3, "legacy_ddp", expect_failure=True)
    lines = [line for line in refused.splitlines() if "error: " in line and "--reset-optimizer" in line]
    assert lines, refused[-3000:]
    assert "holds the state of MemoryEfficientFP16Optimizer and this run builds FairseqAdam" in lines[0]
    assert "Traceback" not in refused and "AssertionError" not in refused, refused[-3000:]
