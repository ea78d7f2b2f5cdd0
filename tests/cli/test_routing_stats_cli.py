"""Routing statistics through the real command lines (--moe-routing-stats): fairseq-generate in one
process and with experts sharded over 2 workers count the same, fairseq-validate counts by language
pair exactly the subset's real tokens.
"""

import pytest

from support.inputs.pruning_runs import statistics, stats_args, train_tiny_set
from support.launch.fairseq_helpers import USER_DIR, run_fairseq, torchrun
from support.launch.multiworker_cli_runs import BIN

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    return train_tiny_set(data, tmp_path_factory.mktemp("routing_stats"))


def test_routing_statistics_count_real_tokens_alike_in_one_process_and_on_2_sharded_workers(trained, tmp_path):
    # 4 batches of 4 sentences: each worker generates two of them
    grouped = ["--moe-routing-stats-groups", str(trained["groups"]), "--batch-size", "4"]
    run_fairseq("generate", *stats_args(trained["data"], trained["set"], tmp_path / "one.json", *grouped))
    torchrun(
        2,
        BIN / "fairseq-generate",
        stats_args(trained["data"], trained["set"], tmp_path / "two.json", *grouped),
        log_dir=tmp_path / "logs",
    )
    one, two = statistics(tmp_path / "one.json"), statistics(tmp_path / "two.json")
    assert one["model"] == two["model"] and one["model"]["set_id"] and one["model"]["top_k"] == 2
    assert set(one["model"]["layers"].values()) == {4} and one["grouped_by"].startswith("file ")
    for layer, entry in one["layers"].items():
        assert set(entry["groups"]) == {"even", "odd"} and entry["side"] == layer.split(".")[0]
        for key, counts in entry["groups"].items():
            other = two["layers"][layer]["groups"][key]
            assert counts["top1"] == other["top1"] and counts["topk"] == other["topk"], (layer, key)
            assert counts["gate_mass"] == pytest.approx(other["gate_mass"], rel=1e-5)
            # every real token: one first choice and k choices
            assert sum(counts["top1"]) == counts["tokens"] and sum(counts["topk"]) == 2 * counts["tokens"]


def test_validate_counts_by_language_pair_the_source_and_target_tokens_of_the_subset(trained, tmp_path):
    args = [
        str(trained["data"]),
        "--user-dir",
        USER_DIR,
        "--task",
        "translation",
        "--path",
        str(trained["set"]),
        "--cpu",
        "--num-workers",
        "0",
        "--valid-subset",
        "test",
        "--max-tokens",
        "2000",
        "--moe-routing-stats",
        str(tmp_path / "v.json"),
    ]
    run_fairseq("validate", *args)
    found = statistics(tmp_path / "v.json")
    assert found["grouped_by"] == "language pair"
    sides = {entry["side"]: entry["groups"] for entry in found["layers"].values()}
    assert set(sides["encoder"]) == {"src"} and set(sides["decoder"]) == {"tgt"}
    from fairseq.data import data_utils

    for side, key in (("encoder", "src"), ("decoder", "tgt")):
        dataset = data_utils.load_indexed_dataset(str(trained["data"] / f"test.src-tgt.{key}"))
        real = sum(len(dataset[i]) for i in range(len(dataset)))  # every token with its EOS, no pad
        assert sides[side][key]["tokens"] == real
