"""--encoder-moe-expert-count / --decoder-moe-expert-count: each side's MoE layers hold their own number of
experts (what prune --encoder-decoder-ratio writes), defaulting to --moe-expert-count; checked against
--moe-top-k in flag words; a set with unequal sides is refused by export-hf (NllbMoe has one num_experts)."""

import pytest

from fairseq_moe_ext.checkpoint.errors import CheckpointSetError
from fairseq_moe_ext.checkpoint.hf.config import hf_config
from fairseq_moe_ext.common.refusal import MoEOptionError
from fairseq_moe_ext.models.moe_config import check_moe_args
from fairseq_moe_ext.moe import MoELayer
from support.inputs.model_namespaces import exportable_options, model_defaults
from support.inputs.tiny_fairseq_models import language_model, translation


def experts_by_side(model):
    counts = {}
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            counts.setdefault(name.split(".")[0], set()).add(module.num_experts)
    return counts


def test_each_side_builds_its_own_expert_count_and_follows_moe_expert_count_without_it(data):
    built = translation(data, "--moe-expert-count", "4", "--encoder-moe-expert-count", "6")
    assert experts_by_side(built.model) == {"encoder": {6}, "decoder": {4}}
    built = translation(data, "--encoder-moe-expert-count", "2", "--decoder-moe-expert-count", "6")
    assert experts_by_side(built.model) == {"encoder": {2}, "decoder": {6}}
    router = dict(built.model.named_parameters())["decoder.layers.1.fc1.router.wg.weight"]
    assert router.shape[0] == 6
    lm = language_model(data, "--moe-expert-count", "4", "--decoder-moe-expert-count", "2")
    assert experts_by_side(lm.model) == {"decoder": {2}}


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_top_k_above_one_side_s_expert_count_is_refused_naming_that_side_s_flag(side):
    with pytest.raises(MoEOptionError) as refused:
        check_moe_args(model_defaults(moe_top_k=3, **{f"{side}_moe_expert_count": 2}))
    assert str(refused.value) == f"--moe-top-k 3 exceeds --{side}-moe-expert-count 2: use --moe-top-k <= 2"
    check_moe_args(model_defaults(moe_top_k=3, **{f"{side}_moe_expert_count": 3}))


def test_export_hf_refuses_unequal_sides_in_one_line_and_writes_equal_ones_as_num_experts():
    with pytest.raises(CheckpointSetError) as refused:
        hf_config(exportable_options(encoder_moe_expert_count=6, decoder_moe_expert_count=2), "ck.pt", 30, "float32")
    assert str(refused.value) == (
        "ck.pt has --encoder-moe-expert-count 6 and --decoder-moe-expert-count 2: NllbMoe has one num_experts for "
        "every sparse layer; export a set with the same number of experts on both sides (prune without "
        "--encoder-decoder-ratio) (nothing was written)"
    )
    config, _ = hf_config(
        exportable_options(encoder_moe_expert_count=4, decoder_moe_expert_count=4), "ck.pt", 30, "float32"
    )
    assert config["num_experts"] == 4  # each side's own count, not --moe-expert-count's 8
