"""More workers than experts through the real command-line tools: 4 workers train 2 experts
(expert-parallel size 2, two replicas of each shard), save each expert once, resume at other
layouts and generate in one process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_helpers import fairseq_env, run_fairseq, torchrun
from test_multiworker_cli import BIN, assert_same_generation, generate, moe_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def data(parallel_data):
    """The session's shared preprocessed parallel corpus (conftest.py), read only."""
    return parallel_data


def checkpoint_tool(*args):
    return subprocess.run([sys.executable, "-m", "fairseq_moe_ext.checkpoint", *map(str, args)],
                          env=fairseq_env(), capture_output=True, text=True)


def test_four_workers_with_two_experts_store_each_expert_once_and_resume_at_two_and_one_workers(data, tmp_path):
    save_dir = tmp_path / "ck"
    two_experts = ("--moe-expert-count", "2", "--ddp-backend", "legacy_ddp")
    output = torchrun(4, BIN / "fairseq-train", moe_args(data, save_dir, 4, *two_experts))
    assert "loss" in output
    manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
    assert (manifest["world_size"], manifest["workers"]) == (2, 4)
    assert all(len(digests) == 2 and len(set(digests)) == 1 for digests in manifest["replicas"]), manifest["replicas"]
    assert sorted(p.name for p in Path(save_dir).glob("checkpoint_last*")) == [
        "checkpoint_last-rank-0-of-2.pt", "checkpoint_last-rank-1-of-2.pt", "checkpoint_last.set.json"]
    report = checkpoint_tool("inspect", save_dir / "checkpoint_last.pt")
    assert report.returncode == 0, report.stdout + report.stderr
    assert "saved by 4 workers: each of the 2 expert shards had 2 replicas" in report.stdout
    assert "VERDICT OK: every shard's replicas were identical when saved" in report.stdout
    assert "VERDICT OK: every expert is distinct" in report.stdout

    reference, _ = generate(data, save_dir / "checkpoint_last.pt")
    merged = tmp_path / "merged.pt"
    assert checkpoint_tool("merge", save_dir / "checkpoint_last.pt", merged).returncode == 0
    assert_same_generation(generate(data, merged)[0], reference)

    # One more update each, at a vanishing learning rate: the layouts are what is being checked.
    vanishing = ("--reset-lr-scheduler", "--lr", "1e-12")
    for workers, update in ((4, 5), (2, 6)):
        output = torchrun(workers, BIN / "fairseq-train", moe_args(data, save_dir, update, *two_experts, *vanishing))
        assert f"as worker 0 of {workers} (expert shard 0 of 2)" in output
        manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
        assert (manifest["world_size"], manifest.get("workers", 2), manifest["num_updates"]) == (2, workers, update)
        assert_same_generation(generate(data, save_dir / "checkpoint_last.pt")[0], reference)
    run_fairseq("train", *moe_args(data, save_dir, 7, *two_experts, *vanishing))
    assert (save_dir / "checkpoint_last.pt").exists() and not (save_dir / "checkpoint_last.set.json").exists()
    assert_same_generation(generate(data, save_dir / "checkpoint_last.pt")[0], reference)
