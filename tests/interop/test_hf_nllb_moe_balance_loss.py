"""The balance loss of an imported nllb-branch model against Hugging Face's ``NllbMoe`` (transformers 4.57.1).

The branch's top-2 gate computes ``l_aux = mean_e(me * ce) * E^2`` (``me``: mean softmax probability of
expert e, ``ce``: fraction of tokens whose first choice is e, before capacity dropping); this plugin's
``E * sum_e(mean_prob * frac)`` is the same number. HF's ``load_balancing_loss_func`` is that form only
under conditions this test meets: NllbMoe hands it each sparse layer's combine weights (the normalised,
post-capacity top-2 gates, not the softmax probabilities) concatenated over layers along the expert axis,
so it equals the branch's ``l_aux`` when there are 2 experts (both chosen: the combine weights are the
probabilities), one sparse layer per side (tests/support/oracles/hf_nllb_moe.py: layer 1 of 3) and nothing is
dropped. HF computes no router z-loss (``router_z_loss_coef`` is unused there), so there is none to compare.
"""

import pytest
import torch

from support.oracles.hf_nllb_moe import NEEDS_TRANSFORMERS, PAD, batch, hf_model, import_hf, oracle_task

pytestmark = [
    *NEEDS_TRANSFORMERS,
    pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema"),
]
SIDES = ("encoder", "decoder")


def balance_losses(model, hf, src, tgt):
    """{side: (this plugin's balance loss of the side's MoE layer, HF's aux loss of that side)}."""
    from transformers.models.nllb_moe.modeling_nllb_moe import load_balancing_loss_func

    lengths = src.ne(PAD).sum(1)
    model(src, lengths, tgt)
    records = model.moe_cache.collect()
    outputs = hf(input_ids=src, decoder_input_ids=tgt, labels=tgt, output_router_logits=True)
    # HF's own function on each side's router outputs: NllbMoe's forward computes its decoder_aux_loss from
    # outputs[4], which (None fields left out of the tuple) is the encoder's router outputs in 4.57.1.
    theirs = {
        s: float(load_balancing_loss_func(*hf._unpack_router_logits(outputs[f"{s}_router_logits"]))) for s in SIDES
    }
    assert theirs["encoder"] == float(outputs.encoder_aux_loss)
    ours = {side: [float(r.aux.balance_loss) for r in records if r.layer.startswith(side)] for side in SIDES}
    assert all(len(values) == 1 for values in ours.values()), ours  # one MoE layer per side
    return {side: (ours[side][0], theirs[side]) for side in SIDES}


def test_each_moe_layers_balance_loss_equals_hf_nllb_moe_aux_loss_on_one_sentence(tmp_path):
    """One unpadded sentence (no pads: the branch averages over pad positions too, this plugin over real tokens),
    in evaluation and in training, whose capacity 2*ceil(S/E) drops nothing with 2 experts on either side."""
    task = oracle_task(tmp_path / "dict")
    hf = hf_model(num_experts=2, moe_token_dropout=0.0)
    model, _ = import_hf(tmp_path, task, hf, moe_expert_count=2, moe_eom=0.0)
    src, tgt = batch([9], [7], seed=3)
    for training in (False, True):
        model.train(training), hf.train(training)
        with torch.set_grad_enabled(training):
            losses = balance_losses(model, hf, src, tgt)
        for side, (ours, theirs) in losses.items():
            assert 1.0 < theirs < 2.0, f"{side}: routing should be measurably unbalanced ({theirs})"
            assert ours == pytest.approx(theirs, abs=1e-6), f"{side}, training={training}"
