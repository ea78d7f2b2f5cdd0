"""Per-side expert pruning end to end (prune --encoder-decoder-ratio): a set whose encoder and decoder keep
different numbers of experts generates, in one process and with experts sharded over 2 workers, exactly
what the unpruned set generates with the dropped experts' router logits at -inf, and fine-tunes with
--encoder-moe-expert-count / --decoder-moe-expert-count."""

import json

import pytest

from support.inputs.pruning_ratio_runs import routers_masked, train_six_expert_set
from support.inputs.pruning_runs import stats_args
from support.launch.fairseq_helpers import run_checkpoint_tool, run_fairseq
from support.launch.multiworker_cli_runs import assert_same_generation, generate, moe_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    trained = train_six_expert_set(data, tmp_path_factory.mktemp("pruning_ratio"))
    stats = trained["root"] / "stats.json"
    groups = ["--moe-routing-stats-groups", str(trained["groups"])]
    run_fairseq("generate", *stats_args(trained["data"], trained["set"], stats, *groups))
    return dict(trained, stats=stats)


def prune(trained, out, *flags):
    out.parent.mkdir(parents=True)
    return run_checkpoint_tool("prune", trained["set"], out, "--stats", trained["stats"], *flags, check=True).stdout


def test_a_set_pruned_to_unequal_sides_generates_as_the_masked_router_in_one_and_two_workers(trained, tmp_path):
    # 3 of 6 per layer, split 1:2 between encoder and decoder: 2 encoder experts and 4 decoder ones
    out = tmp_path / "p" / "ck.pt"
    printed = prune(
        trained, out, "--keep", "3", "--encoder-decoder-ratio", "0.5", "--group", "odd", "--world-size", "2"
    )
    manifest = json.loads((tmp_path / "p" / "ck.set.json").read_text())
    kept = manifest["pruned"]["kept"]
    assert {layer.split(".")[0]: len(ids) for layer, ids in kept.items()} == {"encoder": 2, "decoder": 4}, kept
    assert manifest["pruned"]["encoder_decoder_ratio"] == 0.5 and "encoder 2 (1 per worker)" in printed
    assert {key.split(".")[0]: n for key, n in manifest["num_experts"].items()} == {"encoder": 2, "decoder": 4}
    with routers_masked(kept):
        oracle, _ = generate(trained["data"], trained["set"])
    unmasked, _ = generate(trained["data"], trained["set"])
    assert unmasked != oracle  # the experts dropped mattered
    one, _ = generate(trained["data"], out)
    assert_same_generation(one, oracle)
    two, _ = generate(trained["data"], out, workers=2, log_dir=tmp_path / "logs")
    assert_same_generation(two, one)


def test_a_set_with_unequal_sides_fine_tunes_for_one_update_with_each_side_s_count(trained, tmp_path):
    prune(trained, tmp_path / "p" / "ck.pt", "--keep", "4", "--encoder-decoder-ratio", "3")  # 6:2 of 6 each
    sides = ["--encoder-moe-expert-count", "6", "--decoder-moe-expert-count", "2"]
    args = moe_args(trained["data"], tmp_path / "ft", 1, "--restore-file", str(tmp_path / "p" / "ck.pt"), *sides)
    output = run_fairseq("train", *args)
    assert "Loaded checkpoint" in output
    assert "num_updates: 1 >= max_update: 1" in output or '"num_updates": "1"' in output, output[-2000:]
