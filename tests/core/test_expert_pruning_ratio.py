"""Expert pruning with per-side budgets (prune --encoder-decoder-ratio R, checkpoint/prune.py): how the
experts kept are split between encoder and decoder MoE layers, what the pruned config says, the splits
refused, and the expert-parallel size P of a model whose sides hold different numbers of experts."""

import argparse
import math

import pytest
import torch

from fairseq_moe_ext.checkpoint.errors import CheckpointSetError
from fairseq_moe_ext.checkpoint.prune import split_by_ratio, with_expert_count
from fairseq_moe_ext.checkpoint.sets_cli import expert_parallel_size as set_parallel_size
from fairseq_moe_ext.moe.expert_layout import default_expert_parallel_size
from fairseq_moe_ext.options import expert_count
from fairseq_moe_ext.parallel.plan import resolve_parallel_size as expert_parallel_size

ONE_EACH = {"encoder.layers.1.fc1": 8, "decoder.layers.1.fc1": 8}
TWO_AND_ONE = {"encoder.layers.1.fc1": 8, "encoder.layers.3.fc1": 8, "decoder.layers.1.fc1": 8}


def split(layers, keep, ratio, top_k=2):
    kept = split_by_ratio(layers, dict.fromkeys(layers, keep), top_k, ratio, f"--keep {keep}")
    return [kept[layer] for layer in layers]


@pytest.mark.parametrize(
    "layers, keep, ratio, want",
    [
        (ONE_EACH, 4, 1, [4, 4]),
        (ONE_EACH, 4, 3, [6, 2]),  # Koishekenov et al.'s 3:1
        (ONE_EACH, 4, 1 / 3, [2, 6]),
        (ONE_EACH, 4, 0.6, [3, 5]),
        (ONE_EACH, 3, 2, [4, 2]),
        (TWO_AND_ONE, 4, 1, [4, 4, 4]),
        (TWO_AND_ONE, 4, 2, [5, 5, 2]),  # b = round(12 / (2*2 + 1)) = 2, a = (12 - 2) / 2
        (TWO_AND_ONE, 4, 0.5, [3, 3, 6]),
    ],
)
def test_a_ratio_splits_the_experts_kept_between_the_sides_and_keeps_their_total(layers, keep, ratio, want):
    got = split(layers, keep, ratio)
    assert got == want and sum(got) == keep * len(layers)


@pytest.mark.parametrize(
    "layers, keep, ratio, message",
    [
        (ONE_EACH, 4, 0, "--encoder-decoder-ratio 0 must be a number > 0"),
        (ONE_EACH, 4, -2, "--encoder-decoder-ratio -2 must be a number > 0"),
        (ONE_EACH, 4, math.nan, "--encoder-decoder-ratio nan must be a number > 0"),
        (
            ONE_EACH,
            2,
            3,
            "--encoder-decoder-ratio 3 with --keep 2 (4 experts over 2 MoE layers) keeps 1 per decoder MoE layer, "
            "fewer than the 2 each token is routed to (--moe-top-k): the splits encoder:decoder this budget allows "
            "are 2:2 (R 1); use a ratio near one of them, or keep more experts",
        ),
        (ONE_EACH, 6, 4, "keeps 10 per encoder MoE layer, more than its 8: the splits encoder:decoder this budget"),
        ({"decoder.layers.1.fc1": 8}, 4, 2, "this model has MoE layers in the decoder only: drop"),
    ],
)
def test_a_ratio_that_leaves_a_side_outside_k_to_e_is_refused_in_one_line(layers, keep, ratio, message):
    with pytest.raises(CheckpointSetError) as refused:
        split(layers, keep, ratio)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_pruned_config_names_each_side_s_expert_count_and_one_count_alone():
    model = argparse.Namespace(moe_expert_count=8, moe_expert_parallel_size=4, encoder_moe_expert_count=None)
    cfg = {"model": model, "task": {"data": "x"}}
    unequal = with_expert_count(cfg, {"encoder": 6, "decoder": 2})["model"]
    assert [expert_count(unequal, side) for side in ("encoder", "decoder")] == [6, 2]
    assert unequal.moe_expert_parallel_size is None  # 4 does not divide 6 or 2
    assert model.moe_expert_count == 8 and model.encoder_moe_expert_count is None  # the original is untouched
    equal = with_expert_count({"model": dict(vars(unequal))}, {"encoder": 4, "decoder": 4})["model"]
    assert equal["moe_expert_count"] == 4 and equal["encoder_moe_expert_count"] is None
    assert equal["decoder_moe_expert_count"] is None


def translation_args(**options):
    base = dict(moe_expert_count=8, encoder_layers=2, decoder_layers=2, moe_freq=2)
    return argparse.Namespace(**{**base, **options})


def test_the_default_expert_parallel_size_divides_the_workers_and_each_side_s_experts():
    assert default_expert_parallel_size(4, 6, 2) == 2 and default_expert_parallel_size(8, 8) == 8
    args = translation_args(encoder_moe_expert_count=6, decoder_moe_expert_count=2)
    assert expert_parallel_size(args, 4) == 2
    # a side without MoE layers (or a language model's absent encoder) does not constrain P
    assert expert_parallel_size(translation_args(encoder_moe_expert_count=3, encoder_moe_freq=0), 4) == 4
    assert expert_parallel_size(translation_args(encoder_moe_expert_count=3), 4, sides=("decoder",)) == 4
    full = {"model": {"e": torch.zeros(6, 1), "d": torch.zeros(2, 1)}, "moe": {"expert_keys": ["e", "d"]}}
    assert set_parallel_size(full, 4, None) == 2  # reshard's default P: the same function


def test_an_expert_parallel_size_not_dividing_a_side_s_experts_names_that_side_s_flag():
    args = translation_args(encoder_moe_expert_count=6, moe_expert_parallel_size=4)
    with pytest.raises(ValueError) as refused:
        expert_parallel_size(args, 4)
    assert str(refused.value) == (
        "--moe-expert-parallel-size 4 does not divide --encoder-moe-expert-count 6: use a P dividing both 4 and "
        "--encoder-moe-expert-count 6 and --moe-expert-count 8 (1 or 2)"
    )
