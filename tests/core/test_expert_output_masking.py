"""Expert Output Masking (``--moe-eom P``, NLLB; the nllb branch's ``tok_dropout``), against a direct
reference: every token's output is a sum of its slots' terms ``g_j * expert_j(x)``, computed here one
token and one choice at a time. Training keeps each whole term with probability 1 - P, unscaled;
evaluation scales every term by 1 - P."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig

D, H, E, K = 8, 16, 4, 2


def layer(p, **kw):
    torch.manual_seed(0)
    moe = MoELayer(MoELayerConfig.of(D, H, E, k=K, normalize_gates=True, expert_output_masking=p, **kw))
    with torch.no_grad():
        moe.router.wg.weight.normal_(std=1.0)
    return moe


def slot_terms(moe, x):
    """[N, K, D]: token t's term from its j-th expert, from the definitions (softmax, top-k, renormalised)."""
    terms = []
    for token in x:
        p = torch.softmax(F.linear(token, moe.router.wg.weight), -1)
        chosen = torch.topk(p, K).indices.tolist()
        gates = p[chosen] / p[chosen].sum()
        ex = moe.experts
        terms.append(
            torch.stack(
                [
                    gates[j]
                    * F.linear(
                        F.relu(F.linear(token, ex.batched_fc1_w[e], ex.batched_fc1_b[e])),
                        ex.batched_fc2_w[e],
                        ex.batched_fc2_b[e],
                    )
                    for j, e in enumerate(chosen)
                ]
            )
        )
    return torch.stack(terms)


def test_in_evaluation_every_expert_output_is_scaled_by_one_minus_the_masking_rate():
    moe = layer(0.3).eval()
    x = torch.randn(50, D)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), 0.7 * slot_terms(moe, x).sum(1), rtol=1e-5, atol=1e-6)


def test_training_keeps_each_tokens_expert_output_whole_or_zeroed_at_the_rate_unscaled():
    moe = layer(0.3).train()
    x = torch.randn(4000, D)
    with torch.no_grad():
        y, terms = moe(x), slot_terms(moe, x)
    subsets = [s for r in range(K + 1) for s in itertools.combinations(range(K), r)]  # fewest slots kept first
    kept = torch.tensor([[j in s for j in range(K)] for s in subsets], dtype=terms.dtype)  # [S, K]
    sums = torch.einsum("sk,nkd->nsd", kept, terms)  # [N, S, D]: each token's output were it to keep subset s
    match = torch.isclose(y[:, None], sums, rtol=1e-5, atol=1e-6).all(-1)  # [N, S]
    whole = match.any(1)
    assert whole.all(), (
        f"tokens {whole.logical_not().nonzero().flatten()[:5].tolist()}: output is not a sum of "
        "whole expert terms (element-wise dropout or rescaling?)"
    )
    dropped = int((K - kept.sum(1)[match.int().argmax(1)]).sum())  # per token, its first matching subset's drops
    # 8000 slots at p = 0.3: 2400 dropped expected, standard deviation 41
    assert abs(dropped / (K * x.shape[0]) - 0.3) < 0.025


def test_masking_is_per_slot_so_a_token_can_lose_one_expert_and_keep_the_other():
    moe = layer(0.5).train()
    x = torch.randn(400, D)
    with torch.no_grad():
        y, terms = moe(x), slot_terms(moe, x)
    only_first = [
        torch.allclose(y[t], terms[t, 0], rtol=1e-5, atol=1e-6) and not torch.allclose(terms[t, 1], 0 * terms[t, 1])
        for t in range(x.shape[0])
    ]
    assert 50 < sum(only_first) < 150  # a quarter of the tokens keep exactly their first expert


def test_masking_off_by_default_leaves_training_output_unchanged():
    moe = layer(0.0).train()
    x = torch.randn(30, D)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), slot_terms(moe, x).sum(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 2.0])
def test_a_masking_rate_outside_zero_to_one_is_refused(rate):
    with pytest.raises(ValueError, match="expert_output_masking must be in"):
        layer(rate)
