"""The nllb branch's second-expert policies (``--moe-second-expert-policy``, moe/second_expert.py) and its gate
renormalisation after dropping, against references written from its ``top2gate.py``: per token with the
torch generator seeded as the layer's, and by frequency over many draws. Where Hugging Face's NllbMoe differs
(its random policy compares the draw with the raw second probability even when gates are normalised before
dropping), the branch's rule is what is checked here; tests/interop/test_hf_nllb_moe_routing.py covers the
rest against HF."""

import pytest
import torch
import torch.nn.functional as F

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig

D, H, E = 8, 16, 4


def layer(policy, **kw):
    torch.manual_seed(0)
    moe = MoELayer(MoELayerConfig.of(D, H, E, k=2, second_expert_policy=policy, **kw))
    with torch.no_grad():
        moe.router.wg.weight.normal_(std=1.0)
    return moe.eval()


def expert(moe, e, token):
    ex = moe.experts
    return F.linear(
        F.relu(F.linear(token, ex.batched_fc1_w[e], ex.batched_fc1_b[e])), ex.batched_fc2_w[e], ex.batched_fc2_b[e]
    )


def test_random_policy_keeps_a_second_expert_below_twice_its_gate_normed_as_the_branch():
    moe = layer("random", normalize_gates=True)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    with torch.no_grad():
        y = moe(x)
    torch.manual_seed(5)
    draws = torch.rand(64)  # the layer's one draw per forward: torch.rand_like of the [N] second gates
    raw_decisions = 0
    for t, token in enumerate(x):
        p = torch.softmax(F.linear(token, moe.router.wg.weight), -1)
        first, second = torch.topk(p, 2).indices.tolist()
        g1, g2 = p[first] / (p[first] + p[second]), p[second] / (p[first] + p[second])
        expected = g1 * expert(moe, first, token)
        if 2 * g2 > draws[t]:  # gates normalised before dropping: the draw meets the normalised gate
            expected = expected + g2 * expert(moe, second, token)
        raw_decisions += bool(2 * g2 > draws[t]) != bool(2 * p[second] > draws[t])
        torch.testing.assert_close(y[t], expected, atol=1e-5, rtol=1e-5)  # a kept first slot keeps gate g1
    assert raw_decisions > 0, "no token where the raw and the normalised gate decide differently"


def test_sampling_policy_draws_the_second_expert_by_softmax_over_the_others():
    moe = layer("sampling")
    token = torch.randn(1, D, generator=torch.Generator().manual_seed(2))
    n = 20000
    with torch.no_grad():
        routing = moe.router(token.expand(n, D))
        p = torch.softmax(F.linear(token[0], moe.router.wg.weight), -1)
    first = int(p.argmax())
    assert bool((routing.expert_index[:, 0] == first).all()) and bool((routing.expert_index[:, 1] != first).all())
    others = p.clone()
    others[first] = 0
    expected = others / others.sum()
    seen = torch.bincount(routing.expert_index[:, 1], minlength=E).double() / n
    sigma = (expected * (1 - expected) / n).sqrt()
    assert bool(((seen - expected).abs() <= 5 * sigma + 1e-9).all()), (seen, expected)


def test_random_policy_keeps_the_second_expert_at_twice_its_raw_gate_capped_at_1():
    moe = layer("random")
    tokens = torch.randn(2, D, generator=torch.Generator().manual_seed(3))
    n = 20000
    with torch.no_grad():
        for token in tokens:
            routing = moe.router(token.expand(n, D))
            p = torch.softmax(F.linear(token, moe.router.wg.weight), -1)
            expected = min(1.0, 2 * float(torch.topk(p, 2).values[1]))
            kept = float((routing.expert_index[:, 1] < E).double().mean())
            assert abs(kept - expected) <= 5 * (expected * (1 - expected) / n) ** 0.5 + 1e-9, (kept, expected)


@pytest.mark.parametrize("policy", ["sampling", "random"])
def test_policies_draw_in_evaluation_too_as_the_branch_does(policy):
    moe = layer(policy)
    x = torch.randn(256, D, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.manual_seed(0)
        a = moe.router(x).expert_index
        torch.manual_seed(1)
        b = moe.router(x).expert_index
        torch.manual_seed(0)
        again = moe.router(x).expert_index
    assert not moe.training and not torch.equal(a, b) and torch.equal(a, again)


def test_all_policy_is_plain_top2_and_other_policies_need_top2_softmax_routing():
    x = torch.randn(32, D, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(layer("all").router(x).expert_index, torch.topk(layer("all").router(x).logits, 2).indices)
    with pytest.raises(ValueError, match="top-2 softmax routing"):
        MoELayerConfig.of(D, H, E, k=1, second_expert_policy="sampling")
    with pytest.raises(ValueError, match="unknown second-expert policy"):
        MoELayerConfig.of(D, H, E, k=2, second_expert_policy="third")


def test_gates_renormalised_after_dropping_weight_a_token_that_lost_its_second_slot_by_1():
    # capacity factor 0.5 with 2 experts' worth of tokens on one expert: second slots are dropped
    moe = layer(
        "all", capacity_factor=0.5, eval_capacity_factor=0.5, normalize_gates=True, normalize_gates_after_dropping=True
    )
    x = torch.randn(16, D, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        y = moe(x)
        routing = moe.router(x)
        from fairseq_moe_ext.moe.capacity import expert_capacity, slots_within_capacity

        keep = slots_within_capacity(routing.expert_index, E, expert_capacity(16, E, 2, 0.5))
    checked = 0
    for t, token in enumerate(x):
        p = torch.softmax(F.linear(token, moe.router.wg.weight), -1)
        chosen = torch.topk(p, 2).indices.tolist()
        kept = [e for j, e in enumerate(chosen) if keep[t, j]]
        total = sum(p[e] for e in kept) if kept else 1.0
        expected = sum((p[e] / total * expert(moe, e, token) for e in kept), torch.zeros(D))
        torch.testing.assert_close(y[t], expected, atol=1e-5, rtol=1e-5)
        checked += len(kept) == 1
    assert checked > 0, "no token lost exactly one slot"
