"""Sparse upcycling, in one process: the state conversion and the function it preserves.

The oracle is the dense FFN itself, ``fc2(relu(fc1(x)))``: an upcycled MoE layer with gates
renormalised over the top-k must compute it, whichever experts the router picks (ties included).
The end-to-end checks through fairseq's tools are in test_upcycle_cli.py.
"""

import pytest
import torch
import torch.nn.functional as F

from fairseq_moe_ext.checkpoint import CheckpointSetError
from fairseq_moe_ext.checkpoint.upcycle import UpcycleOptions, check_upcyclable, upcycle_model_state
from fairseq_moe_ext.moe import MoELayer, MoELayerConfig

D, H, E = 8, 16, 4


def dense_model_state(layers=2, seed=0):
    """What fairseq saves for a transformer's FFNs (and one attention weight beside them)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for side in ("encoder", "decoder"):
        for i in range(layers):
            prefix = f"{side}.layers.{i}"
            state[f"{prefix}.fc1.weight"] = torch.randn(H, D, generator=g)
            state[f"{prefix}.fc1.bias"] = torch.randn(H, generator=g)
            state[f"{prefix}.fc2.weight"] = torch.randn(D, H, generator=g)
            state[f"{prefix}.fc2.bias"] = torch.randn(D, generator=g)
            state[f"{prefix}.self_attn.q_proj.weight"] = torch.randn(D, D, generator=g)
    return state


def every_second_layer(side, index):
    return (index + 1) % 2 == 0


def dense_ffn(state, prefix, x):
    hidden = F.relu(F.linear(x, state[f"{prefix}.fc1.weight"], state[f"{prefix}.fc1.bias"]))
    return F.linear(hidden, state[f"{prefix}.fc2.weight"], state[f"{prefix}.fc2.bias"])


def upcycled_layer(moe_state, prefix, k, normalize_gates=True):
    layer = MoELayer(MoELayerConfig.of(D, H, E, k=k, normalize_gates=normalize_gates, activation="relu"))
    layer.load_state_dict({name: moe_state[f"{prefix}.fc1.{name}"] for name in layer.state_dict()})
    return layer.eval()


def test_upcycling_copies_the_ffn_to_every_expert_zeroes_the_router_and_keeps_the_rest():
    dense = dense_model_state()
    moe, expert_keys = upcycle_model_state(dense, UpcycleOptions(experts=E, router_std=0.0), every_second_layer)
    for side in ("encoder", "decoder"):
        kept, upcycled = f"{side}.layers.0", f"{side}.layers.1"
        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
            assert torch.equal(moe[f"{kept}.{name}"], dense[f"{kept}.{name}"])  # not chosen: stays dense
            assert f"{upcycled}.{name}" not in moe
        for dense_name, stacked in (
            ("fc1.weight", "batched_fc1_w"),
            ("fc1.bias", "batched_fc1_b"),
            ("fc2.weight", "batched_fc2_w"),
            ("fc2.bias", "batched_fc2_b"),
        ):
            experts = moe[f"{upcycled}.fc1.experts.{stacked}"]
            assert experts.shape == (E, *dense[f"{upcycled}.{dense_name}"].shape)
            for e in range(E):
                assert torch.equal(experts[e], dense[f"{upcycled}.{dense_name}"])
        assert torch.equal(moe[f"{upcycled}.fc1.router.wg.weight"], torch.zeros(E, D))
        for i in (0, 1):
            key = f"{side}.layers.{i}.self_attn.q_proj.weight"
            assert torch.equal(moe[key], dense[key])
    assert sorted(expert_keys) == sorted(k for k in moe if ".experts." in k)


@pytest.mark.parametrize("router_std", [0.0, 0.5], ids=["zero-router", "random-router"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_upcycled_normalised_gates_compute_the_dense_ffn_whichever_experts_are_picked(k, router_std):
    dense = dense_model_state()
    moe, _ = upcycle_model_state(dense, UpcycleOptions(experts=E, router_std=router_std), every_second_layer)
    x = torch.randn(5, 7, D)
    layer = upcycled_layer(moe, "decoder.layers.1", k)
    with torch.no_grad():
        chosen = layer.router(x.reshape(-1, D)).expert_index
        torch.testing.assert_close(layer(x), dense_ffn(dense, "decoder.layers.1", x), rtol=0, atol=1e-5)
    if router_std:
        assert len(set(chosen[:, 0].tolist())) > 1, "a random router should spread the tokens over experts"


def test_without_normalised_gates_an_upcycled_layer_is_the_dense_ffn_scaled_by_k_over_e():
    """Why the upcycled config turns --moe-normalize-gate on: at a zero router the k gates are 1/E each."""
    dense = dense_model_state()
    moe, _ = upcycle_model_state(dense, UpcycleOptions(experts=E, router_std=0.0), every_second_layer)
    x = torch.randn(3, D)
    with torch.no_grad():
        out = upcycled_layer(moe, "encoder.layers.1", k=2, normalize_gates=False)(x)
    torch.testing.assert_close(out, dense_ffn(dense, "encoder.layers.1", x) * 2 / E, rtol=0, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_an_upcycled_layer_spreads_tokens_over_experts_and_workers_and_is_the_dense_ffn(k):
    # A zero router ties every token: topk sends all of them to the same k experts, so with the 8
    # experts on 2 workers one worker would receive every row.
    experts, tokens = 8, 512
    dense = dense_model_state()
    moe, _ = upcycle_model_state(dense, UpcycleOptions(experts=experts), every_second_layer)
    layer = MoELayer(MoELayerConfig.of(D, H, experts, k=k, normalize_gates=True, activation="relu"))
    layer.load_state_dict({name: moe[f"decoder.layers.1.fc1.{name}"] for name in layer.state_dict()})
    x = F.layer_norm(torch.randn(tokens, D, generator=torch.Generator().manual_seed(7)), (D,))  # as fairseq's FFN input
    with torch.no_grad():
        y, aux = layer.eval().forward_with_aux(x)
    torch.testing.assert_close(y, dense_ffn(dense, "decoder.layers.1", x), rtol=0, atol=1e-5)
    share = aux.stats["expert_slots"] / (k * tokens)
    assert share.max() <= 0.3, share  # a fair share is 1/8; a zero router gives one expert all (k = 1)
    assert max(share[:4].sum(), share[4:].sum()) <= 0.75, share  # worker 0 holds experts 0-3, worker 1 4-7


def test_an_upcycled_top_1_layer_is_exactly_its_dense_ffn_and_its_router_learns():
    # k = 1: the renormalised gate is exactly 1 (an unnormalised softmax gate would scale the FFN by
    # p < 1); its gradient must still reach the router (p / p alone would give none).
    dense = dense_model_state()
    moe, _ = upcycle_model_state(dense, UpcycleOptions(experts=E), every_second_layer)
    layer = upcycled_layer(moe, "encoder.layers.1", k=1).train()
    x = torch.randn(40, D, generator=torch.Generator().manual_seed(8))
    routing = layer.router(x)
    assert torch.equal(routing.gates, torch.ones_like(routing.gates))
    y = layer(x)
    torch.testing.assert_close(y, dense_ffn(dense, "encoder.layers.1", x), rtol=0, atol=1e-6)
    (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
    assert layer.router.wg.weight.grad.abs().max() > 1e-3


def test_upcycling_noise_and_router_weights_are_seeded_and_as_large_as_asked():
    dense = dense_model_state(layers=2)

    def upcycle(seed):
        return upcycle_model_state(dense, UpcycleOptions(E, noise=0.01, router_std=0.1, seed=seed), every_second_layer)[
            0
        ]

    a, b, other = upcycle(3), upcycle(3), upcycle(4)
    key, router = "encoder.layers.1.fc1.experts.batched_fc1_w", "encoder.layers.1.fc1.router.wg.weight"
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[key], other[key]) and not torch.equal(a[router], other[router])
    noise = a[key] - dense["encoder.layers.1.fc1.weight"]
    assert 0.008 < noise.std().item() < 0.012 and not torch.equal(a[key][0], a[key][1])
    assert 0.08 < a[router].std().item() < 0.12


def test_a_checkpoint_that_cannot_be_upcycled_is_refused_in_one_line_naming_the_fix():
    dense = {"model": dense_model_state(layers=1), "cfg": {}}
    cases = [
        (
            {"model": {"decoder.layers.0.conv.weight": torch.zeros(2)}},
            UpcycleOptions(E),
            "has no fairseq feed-forward block",
            "(transformer, transformer_lm)",
        ),
        (
            dict(dense, moe={"expert_keys": []}),
            UpcycleOptions(E),
            "is already an MoE checkpoint",
            "train on from this one with --restore-file",
        ),
        (
            dense,
            UpcycleOptions(E, expert_ffn_dim=2 * H),
            f"--moe-expert-ffn-dim {2 * H} differs from the dense FFN's hidden size {H}",
            f"drop --moe-expert-ffn-dim or pass {H}",
        ),
    ]
    for state, options, problem, fix in cases:
        with pytest.raises(CheckpointSetError) as refused:
            check_upcyclable(state, "x.pt", options)
        assert problem in str(refused.value) and fix in str(refused.value) and "\n" not in str(refused.value)
