"""Expert pruning end to end through the real command lines: the checkpoint tool's prune on routing
statistics from fairseq-generate, generation from the pruned set (one process and experts sharded over
2 workers; keeping every expert generates exactly as the original) and fine-tuning from it.
"""

import json

import pytest

from support.inputs.pruning_runs import stats_args, train_tiny_set
from support.launch.fairseq_helpers import run_checkpoint_tool, run_fairseq
from support.launch.multiworker_cli_runs import assert_same_generation, generate, moe_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    return train_tiny_set(data, tmp_path_factory.mktemp("pruning"))


def prune(trained, out, *flags, stats):
    out.parent.mkdir(parents=True)
    done = run_checkpoint_tool("prune", trained["set"], out, "--stats", stats, *flags, check=True)
    return done.stdout


@pytest.fixture(scope="module")
def stats(trained, tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "stats.json"
    run_fairseq(
        "generate",
        *stats_args(trained["data"], trained["set"], path, "--moe-routing-stats-groups", str(trained["groups"])),
    )
    return path


def test_a_set_pruned_to_keep_every_expert_generates_exactly_as_the_original(trained, stats, tmp_path):
    prune(trained, tmp_path / "all" / "ck.pt", "--keep", "4", stats=stats)
    want, _ = generate(trained["data"], trained["set"])
    got, _ = generate(trained["data"], tmp_path / "all" / "ck.pt")
    assert got == want and len(want) > 10


def test_a_pruned_set_generates_alike_in_one_process_and_sharded_and_records_what_it_kept(trained, stats, tmp_path):
    output = prune(
        trained,
        tmp_path / "p" / "ck.pt",
        "--keep-fraction",
        "0.5",
        "--group",
        "even",
        "--world-size",
        "2",
        "--metric",
        "topk",
        stats=stats,
    )
    manifest = json.loads((tmp_path / "p" / "ck.set.json").read_text())
    assert manifest["world_size"] == 2 and set(manifest["num_experts"].values()) == {2}
    record = manifest["pruned"]
    assert record["groups"] == ["even"] and record["metric"] == "topk" and record["statistics"] == str(stats)
    assert all(len(ids) == 2 and ids == sorted(ids) for ids in record["kept"].values()), record
    assert "kept experts" in output
    one, _ = generate(trained["data"], tmp_path / "p" / "ck.pt")
    two, _ = generate(trained["data"], tmp_path / "p" / "ck.pt", workers=2, log_dir=tmp_path / "logs")
    assert_same_generation(two, one)
    inspected = run_checkpoint_tool("inspect", tmp_path / "p" / "ck.pt", check=True).stdout
    assert "VERDICT PROBLEM" not in inspected


def test_a_pruned_set_fine_tunes_for_one_update_with_the_kept_expert_count(trained, stats, tmp_path):
    prune(trained, tmp_path / "p" / "ck.pt", "--keep", "2", stats=stats)
    # --restore-file names a set (--finetune-from-model takes a single file); the pruned set has no optimizer
    # state, so training starts at update 0 with a fresh optimizer
    args = moe_args(trained["data"], tmp_path / "ft", 1, "--restore-file", str(tmp_path / "p" / "ck.pt"))
    args[args.index("--moe-expert-count") + 1] = "2"
    output = run_fairseq("train", *args)
    assert "Loaded checkpoint" in output and "MoE layers" not in output.split("Loaded checkpoint")[0][-200:]
    assert "num_updates: 1 >= max_update: 1" in output or '"num_updates": "1"' in output, output[-2000:]
