"""``--ddp-backend fully_sharded`` through the real command line: 2 torchrun workers (gloo) save an
ordinary checkpoint set, which resumes bit-exactly under fully_sharded, moves to legacy_ddp and
back, resumes on 1 worker (and a 1-worker set on 2) as legacy_ddp does, generates like a legacy_ddp
set and goes through merge and inspect unchanged. A set saved with the experts sharded over their
replica group (P = 1 < W = 2, ``--moe-fully-sharded-experts sharded``) is an ordinary set too: it
resumes under legacy_ddp and on 1 worker, and legacy_ddp's and a 1-worker set resume with experts
sharded."""

import json
import shutil

import pytest
import torch

from support.launch.fairseq_helpers import json_logs, run_checkpoint_tool, torchrun
from support.launch.in_process_trainer import without_fully_sharded_options
from support.launch.multiworker_cli_runs import generate, moe_args
from support.launch.paths import PROBES
from support.probes.full_precision_logs import carries_every_digit

pytestmark = pytest.mark.slow
TRAIN_EVERY_DIGIT = PROBES / "fairseq_train_every_digit.py"
# P = 1 < W = 2: each MoE layer's 4 experts sharded over both workers (their replica group), 2 each.
SHARDED = ("--moe-expert-parallel-size", "1", "--moe-fully-sharded-experts", "sharded")


def train_args(data, save_dir, max_update, backend, extra=()):
    return moe_args(data, save_dir, max_update, "--no-epoch-checkpoints", "--ddp-backend", backend, *extra)


def losses_by_update(output):
    return {int(r["num_updates"]): float(r["loss"]) for r in json_logs(output)}


def train(data, save_dir, max_update, backend, workers=2, extra=()):
    return torchrun(workers, TRAIN_EVERY_DIGIT, train_args(data, save_dir, max_update, backend, extra))


@pytest.fixture(scope="module")
def runs(parallel_data, tmp_path_factory):
    """fully_sharded to update 4 (saved: ``fs_at4``) and uninterrupted to 8; legacy_ddp to update 4;
    fully_sharded with experts sharded to update 4 (``sharded_at4``)."""
    root = tmp_path_factory.mktemp("fully_sharded")
    train(parallel_data, root / "fs", 4, "fully_sharded")
    shutil.copytree(root / "fs", root / "fs_at4")
    train(parallel_data, root / "legacy", 4, "legacy_ddp")
    shutil.copytree(root / "legacy", root / "legacy_at4")
    uninterrupted = train(parallel_data, root / "fs_full", 8, "fully_sharded")
    train(parallel_data, root / "fs_one_worker_at4", 4, "fully_sharded", workers=1)
    train(parallel_data, root / "sharded_at4", 4, "fully_sharded", extra=SHARDED)
    return {"root": root, "data": parallel_data, "want": losses_by_update(uninterrupted)}


def resumed_losses(runs, start, backend, tmp_path, extra=()):
    save_dir = tmp_path / "resume"
    shutil.copytree(runs["root"] / start, save_dir)
    output = train(runs["data"], save_dir, 8, backend, extra=extra)
    assert "loading set" in output or "Loaded checkpoint" in output, output[-3000:]  # a P = 1 set: one file
    return losses_by_update(output)


def test_a_fully_sharded_set_resumes_under_fully_sharded_bit_exactly(runs, tmp_path):
    got = resumed_losses(runs, "fs_at4", "fully_sharded", tmp_path)
    assert sorted(got) == [5, 6, 7, 8] and carries_every_digit(got.values())
    assert all(got[u] == runs["want"][u] for u in got), (got, runs["want"])


@pytest.mark.parametrize(
    "start, backend, extra",
    [
        ("fs_at4", "legacy_ddp", ()),
        ("legacy_at4", "fully_sharded", ()),
        ("sharded_at4", "legacy_ddp", ()),  # experts sharded over 2 workers, then 2 whole experts each
        ("legacy_at4", "fully_sharded", SHARDED),
    ],
)
def test_a_set_moves_between_fully_sharded_and_legacy_ddp_and_trains_on_alike(runs, tmp_path, start, backend, extra):  # fmt: skip
    """Only the order of the gradients' sums differs between the backends and expert layouts
    (all-reduce against reduce-scatter): the losses agree to float rounding."""
    got = resumed_losses(runs, start, backend, tmp_path, extra)
    assert sorted(got) == [5, 6, 7, 8]
    for update, loss in got.items():
        assert loss == pytest.approx(runs["want"][update], rel=1e-5), (update, got, runs["want"])


@pytest.mark.parametrize(
    "start, workers, extra",
    [("fs_at4", 1, ()), ("fs_one_worker_at4", 2, ()), ("sharded_at4", 1, ()), ("fs_one_worker_at4", 2, SHARDED)],
)
def test_a_fully_sharded_set_resumes_at_another_world_size_as_legacy_ddp_does(runs, tmp_path, start, workers, extra):  # fmt: skip
    """2 -> 1 and 1 -> 2 workers: the set's shared state is cut into the new slices (or kept whole on
    one worker) and the experts regrouped (or cut over their replica group: ``extra`` is SHARDED);
    training goes on as under legacy_ddp from the same set (with the same P)."""
    got = {}
    for backend in ("fully_sharded", "legacy_ddp"):
        save_dir = tmp_path / backend
        shutil.copytree(runs["root"] / start, save_dir)
        flags = extra if backend == "fully_sharded" else without_fully_sharded_options(extra)  # the same P
        got[backend] = losses_by_update(train(runs["data"], save_dir, 6, backend, workers, flags))
    assert sorted(got["fully_sharded"]) == [5, 6] and sorted(got["legacy_ddp"]) == [5, 6], "resumed at update 4"
    for update, loss in got["fully_sharded"].items():
        assert loss == pytest.approx(got["legacy_ddp"][update], rel=1e-5), (update, got)


def test_a_fully_sharded_set_is_an_ordinary_set_that_generates_like_legacy_ddp_and_merges(runs, tmp_path):
    fs, legacy = runs["root"] / "fs_at4", runs["root"] / "legacy_at4"
    for save_dir in (fs, legacy):
        manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
        assert manifest["world_size"] == 2 and manifest["num_updates"] == 4
    states = [torch.load(d / "checkpoint_last-rank-0-of-2.pt", weights_only=False) for d in (fs, legacy)]
    assert states[0]["model"].keys() == states[1]["model"].keys()
    for name, value in states[0]["model"].items():  # whole tensors, the shared ones stored by rank 0
        assert value.shape == states[1]["model"][name].shape, name
        torch.testing.assert_close(value, states[1]["model"][name], rtol=1e-4, atol=1e-5, msg=name)
    slots = states[0]["last_optimizer_state"]["state"]
    assert slots.keys() == states[1]["last_optimizer_state"]["state"].keys()
    assert all(not hasattr(v, "device_mesh") for s in slots.values() for v in s.values())

    hypotheses = [generate(runs["data"], d / "checkpoint_last.pt", in_process=False)[0] for d in (fs, legacy)]
    assert hypotheses[0].keys() == hypotheses[1].keys() and len(hypotheses[0]) > 10
    same = sum(hypotheses[0][i][1] == hypotheses[1][i][1] for i in hypotheses[0])
    assert same >= 0.9 * len(hypotheses[0]), f"{same} of {len(hypotheses[0])} hypotheses alike"

    merged = tmp_path / "merged.pt"
    checkpoint_tool("merge", fs / "checkpoint_last.pt", merged)
    inspected = checkpoint_tool("inspect", fs / "checkpoint_last.pt")
    assert "VERDICT OK: shared parameters are stored once (rank 0)" in inspected
    assert "VERDICT OK: every expert is distinct" in inspected
    assert torch.load(merged, weights_only=False)["model"].keys() == states[0]["model"].keys()


def checkpoint_tool(*args):
    return run_checkpoint_tool(*args, check=True, combined=True).stdout
