"""Multi-worker MoE training, checkpoint sets and generation through the real command-line tools.

Workers are CPU processes launched with torchrun and talking over gloo, exactly as the README
tells users to launch them.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from full_precision_logs import carries_every_digit
from fairseq_helpers import (
    USER_DIR,
    fairseq_env,
    json_logs,
    run_fairseq,
    torchrun,
)
from multiworker_cli_runs import BIN, assert_same_generation, generate, moe_args, rewrite_rank_file
from paths import SUPPORT

pytestmark = pytest.mark.slow
TRAIN_EVERY_DIGIT = SUPPORT / "fairseq_train_every_digit.py"  # fairseq-train logging unrounded losses


def losses_by_update(output):
    return {int(r["num_updates"]): float(r["loss"]) for r in json_logs(output)}


@pytest.fixture(scope="module")
def two_worker_run(data, tmp_path_factory):
    """A 2-worker run saved at update 4 (mid-epoch) and the same run uninterrupted to update 8. The
    uninterrupted one also saves a set every 2 updates and keeps the newest three (sets at 4, 6 and
    8): one run serves the resume, the pruning and the save-schedule tests."""
    root = tmp_path_factory.mktemp("sets")
    uninterrupted = torchrun(
        2,
        TRAIN_EVERY_DIGIT,
        moe_args(data, root / "full", 8, "--save-interval-updates", "2", "--keep-interval-updates", "3"),
    )
    torchrun(2, TRAIN_EVERY_DIGIT, moe_args(data, root / "ck", 4))
    snapshot = root / "at4"
    shutil.copytree(root / "ck", snapshot)
    return {"root": root, "save_dir": root / "ck", "at4": snapshot, "uninterrupted": uninterrupted}


@pytest.fixture(scope="module")
def at4_generation(two_worker_run, data):
    """One-process fairseq-generate from the set saved at update 4: (hypotheses, output), the
    reference of every test that compares a generation with it (generated once)."""
    return generate(data, two_worker_run["at4"] / "checkpoint_last.pt")


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
    subprocess.run(
        [sys.executable, "-m", "fairseq_moe_ext.checkpoint", "merge", save_dir / "checkpoint_last.pt", merged],
        check=True,
        env=fairseq_env(),
    )
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
    cli = [sys.executable, "-m", "fairseq_moe_ext.checkpoint"]
    source = two_worker_run["at4"] / "checkpoint_last.pt"
    run = lambda *a: subprocess.run([*cli, *map(str, a)], check=True, env=fairseq_env(), capture_output=True)
    run("merge", source, tmp_path / "merged.pt")
    run("reshard", tmp_path / "merged.pt", tmp_path / "four" / "ck.pt", "--world-size", "4") if (
        tmp_path / "four"
    ).mkdir() is None else None
    run("merge", tmp_path / "four" / "ck.pt", tmp_path / "again.pt")
    first = torch.load(tmp_path / "merged.pt", weights_only=False)
    second = torch.load(tmp_path / "again.pt", weights_only=False)
    assert first["model"].keys() == second["model"].keys()
    for key in first["model"]:
        assert torch.equal(first["model"][key], second["model"][key]), key
    for slot, entry in first["last_optimizer_state"]["state"].items():
        for name, value in entry.items():
            other = second["last_optimizer_state"]["state"][slot][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other
    refused = subprocess.run(
        [*cli, "merge", source, tmp_path / "merged.pt"], env=fairseq_env(), capture_output=True, text=True
    )
    assert refused.returncode == 2 and "exists; choose another output name" in refused.stderr


def test_inspect_flags_experts_copied_across_ranks_and_shared_weights_that_differ(two_worker_run, tmp_path):
    cli = [sys.executable, "-m", "fairseq_moe_ext.checkpoint", "inspect"]
    healthy = subprocess.run(
        [*cli, two_worker_run["at4"] / "checkpoint_last.pt"], env=fairseq_env(), capture_output=True, text=True
    )
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
    report = subprocess.run([*cli, save_dir / "checkpoint_last.pt"], env=fairseq_env(), capture_output=True, text=True)
    assert report.returncode == 1
    assert f"VERDICT PROBLEM: {key}: expert 0 of rank 0 equals expert 0 of rank 1" in report.stdout
    assert f"VERDICT PROBLEM: shared parameter {shared} differs between rank 0 and rank 1" in report.stdout


@pytest.mark.parametrize(
    "damage, directory, named",
    [
        ("delete", "ck", False),
        # glob metacharacters in the save dir's name; --restore-file named by the user falls back only on request
        ("truncate", "run[1]", True),
    ],
)
def test_a_damaged_set_is_never_loaded_and_the_newest_complete_set_is_used(
    two_worker_run, data, tmp_path, damage, directory, named
):
    save_dir = tmp_path / directory
    shutil.copytree(two_worker_run["at4"], save_dir)
    shutil.copy(save_dir / "checkpoint_last.set.json", save_dir / "keep.json")
    # An older complete set under another name (as --save-interval-updates would leave).
    for rank in range(2):
        shutil.copy(save_dir / f"checkpoint_last-rank-{rank}-of-2.pt", save_dir / f"checkpoint_1_4-rank-{rank}-of-2.pt")
    manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
    for entry in manifest["files"]:
        entry["name"] = entry["name"].replace("checkpoint_last", "checkpoint_1_4")
    (save_dir / "checkpoint_1_4.set.json").write_text(json.dumps(dict(manifest, name="checkpoint_1_4")))
    (save_dir / "keep.json").unlink()
    victim = save_dir / "checkpoint_last-rank-1-of-2.pt"
    if damage == "delete":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:1000])

    refused = run_fairseq(
        "generate",
        str(data),
        "--user-dir",
        USER_DIR,
        "--path",
        str(save_dir / "checkpoint_last.pt"),
        "--cpu",
        "--num-workers",
        "0",
        expect_failure=True,
    )
    assert "CheckpointSetError" in refused and ("is missing" in refused or "bytes, the manifest records" in refused)

    restore = ["--restore-file", str(save_dir / "checkpoint_last.pt"), "--moe-restore-fallback"] if named else []
    output = torchrun(2, BIN / "fairseq-train", moe_args(data, save_dir, 5, *restore))
    assert "is unusable" in output and "using the newest complete set" in output and "checkpoint_1_4.set.json" in output
    assert "Loaded checkpoint" in output and "(epoch 1 @ 4 updates)" in output


def test_without_hard_links_a_two_worker_run_resumes_and_every_save_keeps_a_complete_set(
    two_worker_run, data, tmp_path
):
    from fairseq_moe_ext import checkpoint as moe_ckpt
    from fairseq_moe_ext.training.save_dir_lock import LOCK_NAME

    save_dir = tmp_path / "ck"
    shutil.copytree(two_worker_run["at4"], save_dir)
    # Saves at updates 5 and 6: each first keeps the existing sets as .prev, by copying.
    output = torchrun(
        2, SUPPORT / "fairseq_no_hardlinks_probe.py", moe_args(data, save_dir, 6, "--save-interval-updates", "1")
    )
    assert "loading set" in output and "(epoch 1 @ 4 updates)" in output
    assert (
        "refused hard link" in output
        and f"refused hard link {save_dir}/checkpoint_last.prev-rank-1-of-2.pt.tmp" in output
    )
    assert (
        "copying checkpoint_last-rank-0-of-2.pt to checkpoint_last.prev-rank-0-of-2.pt instead" in output
    )  # rank 0 logs
    for name, updates in (("checkpoint_1_5", 5), ("checkpoint_1_6", 6), ("checkpoint_last", 6)):
        assert moe_ckpt.validate_set(str(save_dir / f"{name}.set.json"))["num_updates"] == updates
    left = sorted(p.name for p in save_dir.iterdir() if ".prev" in p.name or p.name.endswith(".tmp"))
    assert not left, left
    assert not (save_dir / LOCK_NAME).exists()


@pytest.fixture(scope="module")
def one_worker_set_resumed_twice(two_worker_run, data, tmp_path_factory):
    """The 2-worker set resharded to a 1-of-1 set, resumed by 1-process fairseq-train to update 5,
    then again to 6; before the first, the save dir holds the lock of a job that died."""
    from fairseq_moe_ext.training.save_dir_lock import LOCK_NAME, this_job

    save_dir = tmp_path_factory.mktemp("one") / "ck"
    save_dir.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "fairseq_moe_ext.checkpoint",
            "reshard",
            two_worker_run["at4"] / "checkpoint_last.pt",
            save_dir / "checkpoint_last.pt",
            "--world-size",
            "1",
        ],
        check=True,
        env=fairseq_env(),
        capture_output=True,
    )
    died = subprocess.Popen([sys.executable, "-c", "pass"])
    died.wait()
    stale = dict(host=this_job().host, pid=died.pid, started="2026-01-01T00:00:00+00:00", job="died")
    (save_dir / LOCK_NAME).write_text(json.dumps(stale))
    first = run_fairseq("train", *moe_args(data, save_dir, 5))
    after_first = sorted(p.name for p in save_dir.iterdir())
    second = run_fairseq("train", *moe_args(data, save_dir, 6))
    return {"save_dir": save_dir, "outputs": (first, second), "after_first": after_first, "stale": stale}


def test_a_set_resharded_to_one_worker_resumes_in_one_process_twice_in_a_row(one_worker_set_resumed_twice):
    first, second = one_worker_set_resumed_twice["outputs"]
    assert "loading set" in first and "checkpoint_last.set.json as worker 0 of 1" in first
    assert "(epoch 1 @ 4 updates)" in first
    assert "loading file" in second and "(epoch 1 @ 5 updates)" in second
    for names in (
        one_worker_set_resumed_twice["after_first"],
        sorted(p.name for p in one_worker_set_resumed_twice["save_dir"].iterdir()),
    ):
        own = [n for n in names if n.startswith("checkpoint_last")]
        assert own == ["checkpoint_last.pt"], names  # one layout: no rank file or manifest beside it


def test_a_stale_lock_of_a_dead_job_is_taken_over_and_a_finished_run_leaves_no_lock(one_worker_set_resumed_twice):
    from fairseq_moe_ext.training.save_dir_lock import LOCK_NAME

    first, _ = one_worker_set_resumed_twice["outputs"]
    assert (
        f"taking over the lock {one_worker_set_resumed_twice['save_dir'] / LOCK_NAME} of job died "
        f"(pid {one_worker_set_resumed_twice['stale']['pid']}" in first
    )
    assert LOCK_NAME not in one_worker_set_resumed_twice["after_first"]
    assert not (one_worker_set_resumed_twice["save_dir"] / LOCK_NAME).exists()


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


# Files another tool (or a person) left in a save dir: none of them may stop a run or be touched.
# fmt: off
STRAY_MANIFESTS = {
    "another-tools.set.json": '{"foo": 1}',
    "a-list.set.json": "[1, 2, 3]",
    "not-json.set.json": "this is not JSON",
    "stray.prev.set.json": '{"foo": 1}',
}
# fmt: on


def test_stray_manifests_in_the_save_dir_neither_stop_a_two_worker_resume_and_save_nor_are_touched(
    two_worker_run, data, tmp_path
):
    from fairseq_moe_ext import checkpoint as moe_ckpt

    save_dir = tmp_path / "ck"
    shutil.copytree(two_worker_run["at4"], save_dir)
    manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
    # An older complete set to fall back to, so the fallback scans the directory.
    for rank in range(2):
        shutil.copy(save_dir / f"checkpoint_last-rank-{rank}-of-2.pt", save_dir / f"checkpoint_1_4-rank-{rank}-of-2.pt")
    older = dict(
        manifest,
        name="checkpoint_1_4",
        files=[dict(e, name=e["name"].replace("checkpoint_last", "checkpoint_1_4")) for e in manifest["files"]],
    )
    (save_dir / "checkpoint_1_4.set.json").write_text(json.dumps(older))
    (save_dir / "checkpoint_last-rank-1-of-2.pt").unlink()
    for name, text in STRAY_MANIFESTS.items():
        (save_dir / name).write_text(text)
    # Our format, naming a file outside the directory (which exists, and is a valid rank file).
    (tmp_path / "x").mkdir()
    shutil.copy(save_dir / "checkpoint_1_4-rank-1-of-2.pt", tmp_path / "x" / "elsewhere-rank-1-of-2.pt")
    outside = dict(
        older,
        name="elsewhere",
        files=[dict(e, name=f"../x/elsewhere-rank-{e['rank']}-of-2.pt") for e in older["files"]],
    )
    (save_dir / "elsewhere.set.json").write_text(json.dumps(dict(outside, num_updates=99)))
    strays = [*STRAY_MANIFESTS, "elsewhere.set.json"]
    before = {name: (save_dir / name).read_bytes() for name in strays}

    output = torchrun(2, BIN / "fairseq-train", moe_args(data, save_dir, 5))

    assert f"using the newest complete set {save_dir / 'checkpoint_1_4.set.json'}" in output  # not elsewhere's "99"
    assert "(epoch 1 @ 4 updates)" in output
    for name in strays:
        assert (save_dir / name).read_bytes() == before[name], f"{name} was changed"
        assert output.count(f"ignoring {save_dir / name}:") <= 2, f"{name}: more than one warning per worker"
    for name in (n for n in strays if not n.endswith(".prev.set.json")):  # scanned by the fallback on both workers
        assert f"ignoring {save_dir / name}:" in output, name
    saved = moe_ckpt.validate_set(str(save_dir / "checkpoint_last.set.json"))
    assert saved["num_updates"] == 5 and saved["world_size"] == 2
    assert moe_ckpt.load_full(str(save_dir / "checkpoint_last.pt"))["moe"]["num_updates"] == 5
