"""More workers than experts through the real command-line tools: 4 workers train 2 experts
(expert-parallel size 2, two replicas of each shard), train exactly as plain data parallelism does,
save each expert once, resume at other layouts and generate in one process."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from support.launch.fairseq_helpers import json_logs, run_checkpoint_tool, run_fairseq, torchrun
from support.launch.multiworker_cli_runs import BIN, assert_same_generation, generate, moe_args
from support.launch.paths import PROBES
from support.probes.full_precision_logs import carries_every_digit

pytestmark = pytest.mark.slow

TWO_EXPERTS = ("--moe-expert-count", "2", "--ddp-backend", "legacy_ddp")
UPDATES = 4


@pytest.fixture(scope="module")
def replicated_run(data, tmp_path_factory):
    """``UPDATES`` updates on 4 workers with 2 experts (P = 2 by default): its save dir (read only) and
    its output, whose logs carry every digit of the losses."""
    save_dir = tmp_path_factory.mktemp("replicated") / "ck"
    output = torchrun(4, PROBES / "fairseq_train_every_digit.py", moe_args(data, save_dir, UPDATES, *TWO_EXPERTS))
    return save_dir, output


def experts_by_global_id(files):
    """Every expert tensor of a checkpoint set's rank files (in rank order), experts concatenated."""
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    return {key: torch.cat([s["model"][key] for s in states]) for key in states[0]["moe"]["expert_keys"]}


def test_four_workers_sharing_two_expert_shards_train_exactly_as_plain_data_parallelism(data, replicated_run, tmp_path):
    """The same 4 workers with every expert on every worker (P = 1: no all-to-all, every gradient
    summed over the world) see the same batches in every forward, so the routing statistics, losses,
    gradient norms and experts must agree to rounding. (A run without replicas, W = P = 2 with
    --update-freq 2, would see the same batches per update but only half of them per forward: its
    balance loss, and so its gradients, differ.) Summing expert gradients over the world instead of
    the replica group, or routing statistics over the expert-parallel group instead of the world,
    breaks it."""
    save_dir, output = replicated_run
    plain = torchrun(
        4,
        PROBES / "fairseq_train_every_digit.py",
        moe_args(data, tmp_path / "plain", UPDATES, *TWO_EXPERTS, "--moe-expert-parallel-size", "1"),
    )
    got, want = json_logs(output), json_logs(plain)
    assert [int(r["num_updates"]) for r in got] == [int(r["num_updates"]) for r in want] == list(range(1, UPDATES + 1))
    assert carries_every_digit([float(r["loss"]) for r in got]), "losses rounded for display"
    for replicated, reference in zip(got, want):
        for key in ("loss", "moe_gate_loss", "gnorm"):
            assert float(replicated[key]) == pytest.approx(float(reference[key]), rel=1e-6), (
                key,
                replicated,
                reference,
            )
    experts = experts_by_global_id([save_dir / f"checkpoint_last-rank-{r}-of-2.pt" for r in range(2)])
    reference_experts = experts_by_global_id([tmp_path / "plain" / "checkpoint_last.pt"])
    assert experts.keys() == reference_experts.keys() and len(experts) == 8
    for key, value in reference_experts.items():
        torch.testing.assert_close(experts[key], value, rtol=0, atol=1e-5, msg=key)


def test_four_workers_with_two_experts_save_each_once_and_resume_on_two_and_one(data, replicated_run, tmp_path):
    save_dir = tmp_path / "ck"
    shutil.copytree(replicated_run[0], save_dir)  # resumed below, in place
    manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
    assert (manifest["world_size"], manifest["workers"]) == (2, 4)
    assert all(len(digests) == 2 and len(set(digests)) == 1 for digests in manifest["replicas"]), manifest["replicas"]
    assert sorted(p.name for p in Path(save_dir).glob("checkpoint_last*")) == [
        "checkpoint_last-rank-0-of-2.pt",
        "checkpoint_last-rank-1-of-2.pt",
        "checkpoint_last.set.json",
    ]
    report = run_checkpoint_tool("inspect", save_dir / "checkpoint_last.pt")
    assert report.returncode == 0, report.stdout + report.stderr
    assert "saved by 4 workers: each of the 2 expert shards had 2 replicas" in report.stdout
    assert "VERDICT OK: every shard's replicas were identical when saved" in report.stdout
    assert "VERDICT OK: every expert is distinct" in report.stdout

    reference, _ = generate(data, save_dir / "checkpoint_last.pt")
    merged = tmp_path / "merged.pt"
    assert run_checkpoint_tool("merge", save_dir / "checkpoint_last.pt", merged).returncode == 0
    assert_same_generation(generate(data, merged)[0], reference)

    # One more update each, at a vanishing learning rate: the layouts are what is being checked.
    vanishing = ("--reset-lr-scheduler", "--lr", "1e-12")
    for workers, update in ((4, 5), (2, 6)):
        output = torchrun(workers, BIN / "fairseq-train", moe_args(data, save_dir, update, *TWO_EXPERTS, *vanishing))
        assert f"as worker 0 of {workers} (expert shard 0 of 2)" in output
        manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
        assert (manifest["world_size"], manifest.get("workers", 2), manifest["num_updates"]) == (2, workers, update)
        assert_same_generation(generate(data, save_dir / "checkpoint_last.pt")[0], reference)
    run_fairseq("train", *moe_args(data, save_dir, 7, *TWO_EXPERTS, *vanishing))
    assert (save_dir / "checkpoint_last.pt").exists() and not (save_dir / "checkpoint_last.set.json").exists()
    assert_same_generation(generate(data, save_dir / "checkpoint_last.pt")[0], reference)
