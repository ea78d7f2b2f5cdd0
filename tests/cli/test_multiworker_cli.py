"""Multi-worker MoE training, checkpoint sets and generation through the real command-line tools.

Workers are CPU processes launched with torchrun and talking over gloo, exactly as the README
tells users to launch them.
"""

import glob
import json
import os
import re
import shutil

import pytest
import torch

from support.launch.fairseq_helpers import (
    json_logs,
    run_checkpoint_tool,
    torchrun,
)
from support.launch.multiworker_cli_runs import BIN, assert_same_generation, generate, moe_args, rewrite_rank_file
from support.launch.paths import PROBES
from support.probes.full_precision_logs import carries_every_digit

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("two_worker_run")]  # its fixtures: tests/cli/conftest.py
TRAIN_EVERY_DIGIT = PROBES / "fairseq_train_every_digit.py"  # fairseq-train logging unrounded losses


def losses_by_update(output):
    return {int(r["num_updates"]): float(r["loss"]) for r in json_logs(output)}


def test_every_worker_writes_its_rank_file_and_a_manifest_describes_the_set(two_worker_run):
    save_dir = two_worker_run["at4"]
    manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
    assert manifest["world_size"] == 2 and manifest["num_updates"] == 4
    assert [f["name"] for f in manifest["files"]] == [
        "checkpoint_last-rank-0-of-2.pt",
        "checkpoint_last-rank-1-of-2.pt",
    ]
    assert set(manifest["num_experts"].values()) == {4}
    assert not (save_dir / "checkpoint_last.pt").exists()


def test_a_set_stores_shared_state_once(two_worker_run, tmp_path):
    save_dir = two_worker_run["at4"]
    merged = tmp_path / "merged.pt"
    run_checkpoint_tool("merge", save_dir / "checkpoint_last.pt", merged, check=True)
    set_bytes = sum(os.path.getsize(p) for p in glob.glob(str(save_dir / "checkpoint_last-rank-*")))
    assert set_bytes <= 1.05 * os.path.getsize(merged), (set_bytes, os.path.getsize(merged))


def test_resuming_with_the_same_world_size_reproduces_the_uninterrupted_run(two_worker_run, data):
    resumed = torchrun(2, TRAIN_EVERY_DIGIT, moe_args(data, two_worker_run["save_dir"], 8))
    assert "loading set" in resumed
    want = losses_by_update(two_worker_run["uninterrupted"])
    got = losses_by_update(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    assert carries_every_digit(want.values()) and carries_every_digit(got.values()), "losses rounded for display"
    assert all(got[u] == want[u] for u in got), (got, want)


@pytest.mark.parametrize("workers", [1, 4])
def test_resuming_at_another_world_size_keeps_the_model_function(
    two_worker_run, at4_generation, data, tmp_path, workers
):
    save_dir = tmp_path / "ck"
    shutil.copytree(two_worker_run["at4"], save_dir)
    reference, _ = at4_generation
    # One more update at a vanishing learning rate: the reshard is what is being checked.
    output = torchrun(
        workers, BIN / "fairseq-train", moe_args(data, save_dir, 5, "--reset-lr-scheduler", "--lr", "1e-12")
    )
    assert f"as worker 0 of {workers}" in output
    if workers > 1:
        manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
        assert manifest["world_size"] == workers and manifest["num_updates"] == 5
        assert not glob.glob(str(save_dir / "checkpoint_last-rank-*-of-2.pt")), "stale 2-worker files left"
    else:
        assert (save_dir / "checkpoint_last.pt").exists() and not (save_dir / "checkpoint_last.set.json").exists()
    resharded, _ = generate(data, save_dir / "checkpoint_last.pt")
    assert_same_generation(resharded, reference)


def test_generation_from_a_set_is_the_same_in_one_and_two_processes(two_worker_run, at4_generation, data, tmp_path):
    path = two_worker_run["at4"] / "checkpoint_last.pt"
    one, output = at4_generation
    assert "BLEU" in output
    two, _ = generate(data, path, workers=2, log_dir=tmp_path / "logs")
    assert_same_generation(two, one)


def test_merge_and_reshard_round_trip_bit_exactly(two_worker_run, tmp_path):
    source = two_worker_run["at4"] / "checkpoint_last.pt"
    run_checkpoint_tool("merge", source, tmp_path / "merged.pt", check=True)
    (tmp_path / "four").mkdir()
    run_checkpoint_tool("reshard", tmp_path / "merged.pt", tmp_path / "four" / "ck.pt", "--world-size", "4", check=True)
    run_checkpoint_tool("merge", tmp_path / "four" / "ck.pt", tmp_path / "again.pt", check=True)
    first = torch.load(tmp_path / "merged.pt", weights_only=False)
    second = torch.load(tmp_path / "again.pt", weights_only=False)
    assert first["model"].keys() == second["model"].keys()
    for key in first["model"]:
        assert torch.equal(first["model"][key], second["model"][key]), key
    for slot, entry in first["last_optimizer_state"]["state"].items():
        for name, value in entry.items():
            other = second["last_optimizer_state"]["state"][slot][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other
    refused = run_checkpoint_tool("merge", source, tmp_path / "merged.pt")
    assert refused.returncode == 2 and "exists; choose another output name" in refused.stderr


def test_inspect_flags_experts_copied_across_ranks_and_shared_weights_that_differ(two_worker_run, tmp_path):
    healthy = run_checkpoint_tool("inspect", two_worker_run["at4"] / "checkpoint_last.pt")
    assert healthy.returncode == 0 and "VERDICT PROBLEM" not in healthy.stdout, healthy.stdout
    assert "VERDICT OK: every expert is distinct" in healthy.stdout
    assert "RuntimeWarning" not in healthy.stderr, healthy.stderr  # runpy's warning when -m names an imported module

    save_dir = tmp_path / "doctored"
    shutil.copytree(two_worker_run["at4"], save_dir)
    rank0 = torch.load(save_dir / "checkpoint_last-rank-0-of-2.pt", weights_only=False)
    key = "encoder.layers.1.fc1.experts.batched_fc1_w"
    shared = "encoder.layers.0.fc1.weight"

    def doctor(state):
        state["model"][key][0] = rank0["model"][key][0]  # the reference thread's symptom
        state["model"][shared] = rank0["model"][shared] + 1.0  # a shared tensor that disagrees

    rewrite_rank_file(save_dir, 1, doctor)
    report = run_checkpoint_tool("inspect", save_dir / "checkpoint_last.pt")
    assert report.returncode == 1
    assert f"VERDICT PROBLEM: {key}: expert 0 of rank 0 equals expert 0 of rank 1" in report.stdout
    assert f"VERDICT PROBLEM: shared parameter {shared} differs between rank 0 and rank 1" in report.stdout


def test_the_hub_interface_loads_a_set_with_every_expert_local(two_worker_run, data):
    from fairseq_moe_ext.models.moe_transformer import MoETransformerModel

    hub = MoETransformerModel.from_pretrained(
        str(two_worker_run["at4"]), checkpoint_file="checkpoint_last.pt", data_name_or_path=str(data)
    )
    experts = [p for n, p in hub.models[0].named_parameters() if n.endswith("experts.batched_fc1_w")]
    assert experts and all(p.shape[0] == 4 for p in experts)
    assert isinstance(hub.translate("s1 s2 s3 s4"), str)


def test_two_runs_with_the_same_seed_end_in_bit_identical_checkpoints(two_worker_run):
    from fairseq_moe_ext import checkpoint as moe_ckpt

    # Same data, seed and world size; only the save schedule differs (one save at update 4, against
    # saves every 2 updates), which must not matter.
    first = moe_ckpt.load_full(str(two_worker_run["at4"] / "checkpoint_last.pt"))
    second = moe_ckpt.load_full(str(two_worker_run["root"] / "full" / "checkpoint_1_4.pt"))
    assert first["moe"]["num_updates"] == second["moe"]["num_updates"] == 4
    for key, value in first["model"].items():
        assert torch.equal(value, second["model"][key]), key
    for slot, entry in first["last_optimizer_state"]["state"].items():
        for name, value in entry.items():
            other = second["last_optimizer_state"]["state"][slot][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (slot, name)


def test_keep_interval_updates_prunes_whole_sets(two_worker_run):
    names = sorted(p.name for p in (two_worker_run["root"] / "full").iterdir())
    kept = [n for n in names if n.startswith("checkpoint_1_")]
    assert kept == [
        "checkpoint_1_4-rank-0-of-2.pt",
        "checkpoint_1_4-rank-1-of-2.pt",
        "checkpoint_1_4.set.json",
        "checkpoint_1_6-rank-0-of-2.pt",
        "checkpoint_1_6-rank-1-of-2.pt",
        "checkpoint_1_6.set.json",
        "checkpoint_1_8-rank-0-of-2.pt",
        "checkpoint_1_8-rank-1-of-2.pt",
        "checkpoint_1_8.set.json",
    ], names


def test_fairseq_loads_a_set_by_its_plain_name(two_worker_run):
    from fairseq import checkpoint_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(str(two_worker_run["at4"] / "checkpoint_last.pt"))
    assert (
        state["moe"]["world_size"] == 1 and state["model"]["encoder.layers.1.fc1.experts.batched_fc1_w"].shape[0] == 4
    )


def test_every_rank_file_of_a_training_save_names_its_set_and_the_experts_it_holds(two_worker_run):
    save_dir = two_worker_run["at4"]
    manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
    metas = [torch.load(save_dir / f"checkpoint_last-rank-{r}-of-2.pt", weights_only=False)["moe"] for r in range(2)]
    assert re.fullmatch(r"[0-9a-f]{16}", manifest["set_id"])
    assert [(m["rank"], m["world_size"], m["set_id"], m["experts_held"]) for m in metas] == [
        (0, 2, manifest["set_id"], [0, 1]),
        (1, 2, manifest["set_id"], [2, 3]),
    ]
