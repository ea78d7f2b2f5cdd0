"""The nllb branch's routing semantics, imported, against Hugging Face's NllbMoe (transformers 4.57.1) where it
drops: evaluation capacity ceil(f * S) below 1 with both gate normalisation orders, batch-major queues,
batch-prioritised routing, replicas in the source set, another output world size, and the second-expert
policies with HF's and our torch generator seeded alike. Where HF and the branch differ (the random policy's
gate with normalisation before dropping), tests/core/test_second_expert_policy.py checks the branch's rule."""

from dataclasses import fields, replace

import pytest
import torch

from fairseq_moe_ext.models.moe_layers import MoEFeedForward
from fairseq_moe_ext.moe import MoELayerConfig, RoutingConfig
from support.oracles.hf_nllb_moe import (
    NEEDS_TRANSFORMERS,
    PAD,
    TOLERANCE,
    TorchWithoutLayerdropDraws,
    assert_same_as_hf,
    batch,
    hf_model,
    import_hf,
    oracle_task,
)

pytestmark = [
    *NEEDS_TRANSFORMERS,
    pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema"),
]
FRACTION = 0.25  # the branch's default: ceil(S/4) slots per expert for 2S slots over 4 experts, most dropped
ONE_SENTENCE, SEVERAL = ([13], [9]), ([7, 7, 7, 7], [6, 6, 6, 6])


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return oracle_task(tmp_path_factory.mktemp("hf_routing_dict"))


def both(tmp_path, task, before=False, prioritized=False, policy="all", ranks=2, world=1, fraction=FRACTION):
    hf = hf_model(
        normalize_router_prob_before_dropping=before,
        batch_prioritized_routing=prioritized,
        moe_eval_capacity_token_fraction=fraction,
        second_expert_policy=policy,
    )
    model, printed = import_hf(
        tmp_path,
        task,
        hf,
        ranks=ranks,
        world=world,
        use_moe_pad_mask=True,
        moe_normalize_gate_prob_before_dropping=before,
        moe_batch_prioritized_routing=prioritized,
        moe_eval_capacity_token_fraction=fraction,
        moe_second_expert_policy=policy,
    )
    return model, hf, printed


def logits(model, src, tgt, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model(src, src.ne(PAD).sum(1), tgt)[0]


def hf_logits(hf, src, tgt, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return hf(
            input_ids=src,
            attention_mask=src.ne(PAD).long(),
            decoder_input_ids=tgt,
            decoder_attention_mask=tgt.ne(PAD).long(),
        ).logits


ROUTING_FIELDS = {f.name for f in fields(RoutingConfig)}
LAYER_FIELDS = {f.name for f in fields(MoELayerConfig)}


def set_layers(model, **values):
    """Change an option of every MoE layer of a loaded model: a field of its (frozen) config through a
    new config, anything else (the fairseq layer's ``batch_major``) as an attribute."""
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            config, routing = module.config, module.config.routing
            for name, value in values.items():
                if name in ROUTING_FIELDS:
                    routing = replace(routing, **{name: value})
                elif name in LAYER_FIELDS:
                    config = replace(config, **{name: value})
                else:
                    setattr(module, name, value)
            module.config = replace(config, routing=routing)


def differ(a, b):
    return (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("before", [False, True], ids=["normalised-after-dropping", "normalised-before"])
@pytest.mark.parametrize("lengths", [ONE_SENTENCE, SEVERAL], ids=["one-sentence", "four-sentences"])
def test_with_a_token_fraction_below_1_imported_models_drop_as_hf_and_compute_its_outputs(
    tmp_path, task, before, lengths
):
    model, hf, printed = both(tmp_path, task, before=before)
    assert f"--moe-eval-capacity-token-fraction {FRACTION}" in printed
    assert f"--moe-normalize-gate-after-dropping {not before}" in printed
    src, tgt = batch(*lengths)
    assert_same_as_hf(model, hf, src, tgt)
    hf.config.moe_eval_capacity_token_fraction = 1.0
    for module in hf.modules():  # HF reads the fraction from its routers
        if hasattr(module, "moe_eval_capacity_token_fraction"):
            module.moe_eval_capacity_token_fraction = 1.0
    assert differ(logits(model, src, tgt), hf_logits(hf, src, tgt)), "nothing was dropped: the test tests nothing"
    # and the other normalisation order is measurably another function where slots are dropped
    set_layers(model, normalize_gates_after_dropping=before)
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            module.router.normalize_gates = not before
    hf.model.apply(
        lambda m: (
            setattr(m, "moe_eval_capacity_token_fraction", FRACTION)
            if hasattr(m, "moe_eval_capacity_token_fraction")
            else None
        )
    )
    assert differ(logits(model, src, tgt), hf_logits(hf, src, tgt))


def test_only_batch_major_queues_drop_the_slots_hf_and_the_branch_drop(tmp_path, task):
    model, hf, printed = both(tmp_path, task)
    assert "--moe-batch-major-routing True" in printed
    src, tgt = batch(*SEVERAL)
    torch.testing.assert_close(logits(model, src, tgt), hf_logits(hf, src, tgt), **TOLERANCE)
    set_layers(model, batch_major=False)  # fairseq's T x B order: other slots are dropped
    assert differ(logits(model, src, tgt), hf_logits(hf, src, tgt))


@pytest.mark.parametrize("before", [False, True], ids=["normalised-after-dropping", "normalised-before"])
def test_batch_prioritised_routing_drops_as_hf_ranking_by_top1_probability(tmp_path, task, before):
    # ranked by the top-1 probability over all experts, not by the gate renormalised over the two
    model, hf, _ = both(tmp_path, task, prioritized=True, before=before)
    src, tgt = batch(*SEVERAL)
    assert_same_as_hf(model, hf, src, tgt)
    set_layers(model)
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            module.router.batch_prioritized = False
    assert differ(logits(model, src, tgt), hf_logits(hf, src, tgt))


@pytest.mark.parametrize("ranks, world", [(8, 2), (2, 4)], ids=["replicas-into-2", "2-rank-files-into-4"])
def test_replicas_and_another_world_size_drop_as_hf(tmp_path, task, ranks, world):
    model, hf, _ = both(tmp_path, task, ranks=ranks, world=world)
    assert_same_as_hf(model, hf, *batch(*SEVERAL))


def test_with_padding_and_drops_imported_models_match_hf_that_masks_pads_but_counts_them(tmp_path, task):
    # HF (and the branch with --use-moe-pad-mask) count pads in S but give them no place in any queue; with
    # --moe-eval-capacity-token-fraction this plugin counts them in S too.
    model, hf, _ = both(tmp_path, task)
    assert_same_as_hf(model, hf, *batch([7, 3, 5, 9], [4, 8, 2, 6]))


@pytest.mark.parametrize("policy", ["sampling", "random"])
@pytest.mark.parametrize("fraction", [1.0, FRACTION], ids=["nothing-dropped", "dropping"])
def test_second_expert_policies_draw_what_hf_draws_from_the_same_seed_in_evaluation(
    tmp_path, task, policy, fraction, monkeypatch
):
    from transformers.models.nllb_moe import modeling_nllb_moe

    monkeypatch.setattr(modeling_nllb_moe, "torch", TorchWithoutLayerdropDraws(torch))
    model, hf, printed = both(tmp_path, task, policy=policy, fraction=fraction)
    assert f"--moe-second-expert-policy {policy}" in printed.split("flags: ")[1]
    src, tgt = batch(*SEVERAL)
    for seed in (0, 1):
        torch.testing.assert_close(logits(model, src, tgt, seed), hf_logits(hf, src, tgt, seed), **TOLERANCE)
    # the draws happen in evaluation too, as in the branch: another seed, other second experts
    assert differ(logits(model, src, tgt, 0), logits(model, src, tgt, 1))


def test_import_hf_maps_the_routing_options_and_drops_as_hf(tmp_path, task):
    # NllbMoe's own checkpoint (save_pretrained) with a fraction below 1, gates normalised after dropping and the
    # random policy: import-hf maps each to its option here, and the imported set computes HF's logits.
    from fairseq import checkpoint_utils
    from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool

    hf = hf_model(moe_eval_capacity_token_fraction=FRACTION, normalize_router_prob_before_dropping=False)
    hf.save_pretrained(tmp_path / "hf")
    assert checkpoint_tool(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported.pt")]) == 0
    model = checkpoint_utils.load_model_ensemble([str(tmp_path / "imported.pt")], task=task)[0][0].eval()
    args = model.args if hasattr(model, "args") else model.cfg
    assert (
        args.moe_eval_capacity_token_fraction,
        args.moe_normalize_gate_after_dropping,
        args.moe_batch_major_routing,
    ) == (FRACTION, True, True)
    src, tgt = batch(*SEVERAL)
    torch.testing.assert_close(logits(model, src, tgt), hf_logits(hf, src, tgt), **TOLERANCE)


def test_export_hf_of_an_imported_branch_set_carries_its_routing_options_to_hf(tmp_path, task):
    # nllb layout (fraction 0.25, gates normalised after dropping) -> import-fairseq-moe -> export-hf -> HF loads
    # it and drops what the original drops
    from transformers import NllbMoeForConditionalGeneration

    from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool

    model, hf, _ = both(tmp_path, task)
    assert checkpoint_tool(["export-hf", str(tmp_path / "imported.pt"), str(tmp_path / "hf_out")]) == 0
    exported = NllbMoeForConditionalGeneration.from_pretrained(tmp_path / "hf_out").eval()
    assert (
        exported.config.moe_eval_capacity_token_fraction,
        exported.config.normalize_router_prob_before_dropping,
        exported.config.second_expert_policy,
    ) == (FRACTION, False, "all")
    src, tgt = batch(*SEVERAL)
    torch.testing.assert_close(hf_logits(exported, src, tgt), hf_logits(hf, src, tgt), **TOLERANCE)
