"""``import-hf`` and ``export-hf`` with the nllb routing options, against transformers' NllbMoe (4.57.1):
an evaluation capacity of ceil(0.25 * S) slots (most second choices dropped) with the gates renormalised
before and after dropping, and the sampling second-expert policy with HF's and our torch generator seeded
alike. HF's own ``save_pretrained`` directory -> import-hf -> this plugin's logits; that set -> export-hf ->
HF ``from_pretrained`` -> HF's logits again. fp32, eval, no padding, one sentence and several."""

import json

import pytest
import torch

from fairseq_moe_ext.checkpoint.__main__ import main as checkpoint_tool
from support.oracles.hf_nllb_moe import (
    NEEDS_TRANSFORMERS,
    TOLERANCE,
    TorchWithoutLayerdropDraws,
    batch,
    hf_model,
    oracle_task,
)

# slow: each case builds Hugging Face NllbMoe and fairseq models end to end, about 4 s of CPU for its
# 4 cases (7 Dec 2026): too much for the fast tier (--fast) run after every edit.
pytestmark = [
    *NEEDS_TRANSFORMERS,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]
FRACTION = 0.25
ONE_SENTENCE, SEVERAL = ([13], [9]), ([7, 7, 7, 7], [6, 6, 6, 6])
ROUTING = ("second_expert_policy", "normalize_router_prob_before_dropping", "moe_eval_capacity_token_fraction")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return oracle_task(tmp_path_factory.mktemp("hf_exchange_routing_dict"))


def imported(tmp_path, task, hf):
    """HF's save_pretrained -> import-hf -> fairseq's load_model_ensemble (eval)."""
    from fairseq import checkpoint_utils

    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    (tmp_path / "ours").mkdir()
    assert checkpoint_tool(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ours" / "ck.pt")]) == 0
    models, _ = checkpoint_utils.load_model_ensemble([str(tmp_path / "ours" / "ck.pt")], task=task)
    return models[0].eval()


def exported(tmp_path):
    """The imported set -> export-hf -> HF's from_pretrained (eval)."""
    from transformers import NllbMoeForConditionalGeneration

    assert checkpoint_tool(["export-hf", str(tmp_path / "ours" / "ck.pt"), str(tmp_path / "back")]) == 0
    return NllbMoeForConditionalGeneration.from_pretrained(str(tmp_path / "back")).eval()


def ours_logits(model, src, tgt, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model(src, torch.full((src.shape[0],), src.shape[1]), tgt)[0]


def hf_logits(hf, src, tgt, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return hf(input_ids=src, decoder_input_ids=tgt).logits


@pytest.mark.parametrize("before", [False, True], ids=["normalised-after-dropping", "normalised-before"])
def test_an_hf_model_that_drops_imports_and_exports_back_with_hf_logits_both_ways(tmp_path, task, before):
    hf = hf_model(moe_eval_capacity_token_fraction=FRACTION, normalize_router_prob_before_dropping=before)
    model = imported(tmp_path, task, hf)
    back = exported(tmp_path)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert [config[name] for name in ROUTING] == ["all", before, FRACTION]
    dropless = hf_model(moe_eval_capacity_token_fraction=1.0, normalize_router_prob_before_dropping=before)
    for lengths in (ONE_SENTENCE, SEVERAL):
        src, tgt = batch(*lengths)
        theirs = hf_logits(hf, src, tgt)
        torch.testing.assert_close(ours_logits(model, src, tgt), theirs, **TOLERANCE)
        torch.testing.assert_close(hf_logits(back, src, tgt), theirs, **TOLERANCE)
        # slots were dropped: the same weights evaluated dropless are another function
        assert (hf_logits(dropless, src, tgt) - theirs).abs().max() > 1e-3, "nothing was dropped"


@pytest.mark.parametrize("fraction", [1.0, FRACTION], ids=["nothing-dropped", "dropping"])
def test_a_sampling_policy_draws_as_hf_does_from_one_seed_after_import_and_export(
    tmp_path, task, monkeypatch, fraction
):
    from transformers.models.nllb_moe import modeling_nllb_moe

    # HF draws torch.rand([]) for layerdrop before every layer, in evaluation too: answered without the generator
    monkeypatch.setattr(modeling_nllb_moe, "torch", TorchWithoutLayerdropDraws(torch))
    hf = hf_model(second_expert_policy="sampling", moe_eval_capacity_token_fraction=fraction)
    model = imported(tmp_path, task, hf)
    back = exported(tmp_path)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["second_expert_policy"] == "sampling"
    src, tgt = batch(*SEVERAL)
    for seed in (0, 1):
        theirs = hf_logits(hf, src, tgt, seed)
        torch.testing.assert_close(ours_logits(model, src, tgt, seed), theirs, **TOLERANCE)
        torch.testing.assert_close(hf_logits(back, src, tgt, seed), theirs, **TOLERANCE)
    # the draws decide: another seed, other second experts
    assert (ours_logits(model, src, tgt, 0) - ours_logits(model, src, tgt, 1)).abs().max() > 1e-3
