"""Specification of shared experts (DeepSeek-MoE), loss-free balancing by a per-expert bias and the
sigmoid router (DeepSeek-V3) in the fairseq-free MoE core."""

import pytest
import torch

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig, RoutingConfig, TopKRouter
from fairseq_moe_ext.moe.balance_bias import BalanceBias, update_balance_biases
from fairseq_moe_ext.moe.experts import is_expert
from fairseq_moe_ext.moe.reference import assert_layer_matches_reference, reference_bias_update, reference_moe

D, H, E = 12, 20, 4


def make_layer(router_type="sigmoid", k=2, shared=0, bias_rate=None, num_experts=E, **kw):
    torch.manual_seed(0)
    config = MoELayerConfig.of(
        D,
        H,
        num_experts,
        k=k,
        router_type=router_type,
        shared_expert_count=shared,
        shared_expert_dim=kw.pop("shared_dim", None),
        balance_bias_rate=bias_rate,
        **kw,
    )
    return MoELayer(config, seed=3)


def set_bias(layer, values):
    layer.router.balance_bias.bias.copy_(torch.tensor(values))


@pytest.mark.parametrize("router_type", ["top", "sigmoid"])
@pytest.mark.parametrize("shared, shared_dim", [(0, None), (2, None), (3, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("cf", [0.0, 0.5])
@pytest.mark.parametrize("padded", [False, True])
def test_layer_with_shared_experts_bias_and_sigmoid_router_equals_a_per_token_reference(
    router_type, shared, shared_dim, with_bias, cf, padded
):
    layer = make_layer(
        router_type,
        shared=shared,
        shared_dim=shared_dim,
        bias_rate=0.01 if with_bias else None,
        capacity_factor=cf,
        eval_capacity_factor=cf,
    )
    if with_bias:  # large enough to change choices
        set_bias(layer, [0.3, -0.2, 0.0, 0.25] if router_type == "sigmoid" else [0.2, -0.1, 0.0, 0.15])
    x = torch.randn(3, 7, D, requires_grad=True)
    # fairseq hands the layer no mask at all when a batch has no padding (its own has_pads test).
    mask = None
    if padded:
        mask = torch.zeros(3, 7, dtype=torch.bool)
        mask[0, 4:] = True
    assert_layer_matches_reference(layer, x, mask, torch.randn(3, 7, D))
    if shared:
        assert layer.shared_experts.ffn.batched_fc1_w.shape == (1, shared * (shared_dim or H), D)


def test_the_balance_bias_changes_which_experts_are_chosen_but_not_the_gate_values():
    router, bias = TopKRouter(D, E, RoutingConfig(k=2, router_type="sigmoid")), BalanceBias(E)
    x = torch.randn(50, D)
    before = router(x, bias.bias)
    bias.bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))  # forces experts 0 and 1
    after = router(x, bias.bias)
    assert torch.equal(after.expert_index.sort(-1).values, torch.tensor([[0, 1]] * 50))
    assert not torch.equal(before.expert_index.sort(-1).values, after.expert_index.sort(-1).values)
    scores = torch.sigmoid(router.compute_logits(x)).gather(1, after.expert_index)
    torch.testing.assert_close(after.gates, scores / scores.sum(-1, keepdim=True))


def test_sigmoid_gates_are_chosen_scores_normalised_over_k_and_probs_over_all_experts():
    router = TopKRouter(D, 6, RoutingConfig(k=3, router_type="sigmoid"))
    x = torch.randn(20, D)
    routing = router(x)
    scores = torch.sigmoid(x @ router.wg.weight.t())
    top = scores.topk(3, dim=-1)
    assert torch.equal(routing.expert_index, top.indices)
    torch.testing.assert_close(routing.gates, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(routing.probs, scores / scores.sum(-1, keepdim=True))


def test_the_bias_moves_by_the_rate_towards_the_mean_load_since_the_last_update():
    layer = make_layer("top", bias_rate=0.05)
    set_bias(layer, [0.1, -0.1, 0.05, 0.0])
    bias = layer.router.balance_bias.bias.clone()
    choices = []
    g = torch.Generator().manual_seed(4)
    for size in (30, 3):  # two micro-batches of one update
        x = torch.randn(size, D, generator=g)
        layer(x)
        reference_moe(layer, x, choices_out=choices)
    update_balance_biases(layer)
    want = reference_bias_update(bias, choices, E, 0.05)
    assert not torch.equal(want, bias)
    assert not torch.equal(want, reference_bias_update(bias, choices[30:], E, 0.05)), "both micro-batches count"
    torch.testing.assert_close(layer.router.balance_bias.bias, want.float(), rtol=0, atol=1e-7)
    # The load was spent: an update without a forward in between leaves the bias alone.
    update_balance_biases(layer)
    torch.testing.assert_close(layer.router.balance_bias.bias, want.float(), rtol=0, atol=1e-7)


def test_validation_and_inference_neither_count_load_nor_move_the_bias():
    layer = make_layer("sigmoid", bias_rate=0.05).eval()
    layer(torch.randn(30, D))
    update_balance_biases(layer)
    assert torch.equal(layer.router.balance_bias.bias, torch.zeros(E))


def test_the_load_behind_the_bias_counts_the_real_tokens_choices_and_no_pad_token():
    layer = make_layer("sigmoid", bias_rate=0.05)
    x, pads = torch.randn(3, 10, D), torch.zeros(3, 10, dtype=torch.bool)
    pads[0, 7:], pads[2, 2:] = True, True
    layer(x, padding_mask=pads)
    real = x[~pads]
    chosen = layer.router(real).expert_index
    assert torch.equal(layer.router.balance_bias.pending_load, torch.bincount(chosen.reshape(-1), minlength=E))


def test_a_skipped_optimizer_step_drops_the_load_it_counted():
    layer = make_layer("sigmoid", bias_rate=0.05)
    layer(torch.randn(30, D))
    update_balance_biases(layer, stepped=False)
    update_balance_biases(layer)
    assert torch.equal(layer.router.balance_bias.bias, torch.zeros(E))


def test_the_bias_is_a_saved_fp32_buffer_even_in_a_half_precision_model():
    layer = make_layer("sigmoid", bias_rate=0.001)
    set_bias(layer, [0.5, -0.25, 0.001, 0.0])
    layer.half()
    assert layer.router.balance_bias.bias.dtype == torch.float32
    assert layer.experts.batched_fc1_w.dtype == torch.float16
    state = layer.state_dict()
    assert torch.equal(state["router.balance_bias.bias"], torch.tensor([0.5, -0.25, 0.001, 0.0]))
    fresh = make_layer("sigmoid", bias_rate=0.001)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.router.balance_bias.bias, state["router.balance_bias.bias"])


def test_shared_experts_are_identical_shared_parameters_on_every_worker_unlike_routed():
    layer = make_layer("top", shared=2)
    shared = list(layer.shared_experts.parameters())
    assert shared and not any(is_expert(p) for p in shared)
    assert all(is_expert(p) for p in layer.experts.parameters())
    torch.manual_seed(123)  # a different global RNG (as another worker's) gives the same shared experts
    other = MoELayer(MoELayerConfig.of(D, H, E, k=2, shared_expert_count=2), seed=3)
    for a, b in zip(shared, other.shared_experts.parameters()):
        assert torch.equal(a, b)
    ffn = layer.shared_experts.ffn.batched_fc1_w[0]
    assert not any(torch.equal(ffn[:H], w) for w in layer.experts.batched_fc1_w)


def imbalance_over_training(router_type, k, num_experts, bias_rate, updates=100):
    """max load / mean load of each update of a small regression trained through the real layer
    (no balance loss), with a router skewed towards expert 0."""
    torch.manual_seed(0)
    layer = MoELayer(
        MoELayerConfig.of(16, 16, num_experts, k=k, router_type=router_type, balance_bias_rate=bias_rate), seed=1
    )
    g = torch.Generator().manual_seed(2)
    direction = torch.zeros(16)
    direction[0] = 1.0
    with torch.no_grad():
        layer.router.wg.weight[0] += 3 * direction
    teacher = torch.randn(16, 16, generator=g) / 4
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    imbalance = []
    for _ in range(updates):
        x = torch.randn(256, 16, generator=g) + direction
        y, aux = layer.forward_with_aux(x)
        load = aux.stats["expert_slots"]
        imbalance.append(float(load.max() / load.mean()))
        optimizer.zero_grad()
        ((y - x @ teacher) ** 2).mean().backward()
        optimizer.step()
        update_balance_biases(layer)
    return imbalance


@pytest.mark.parametrize("router_type, k, num_experts", [("sigmoid", 2, 8), ("top", 1, 4)])
def test_only_bias_balancing_brings_a_skewed_router_below_1_3_imbalance_in_100_updates(router_type, k, num_experts):
    without = imbalance_over_training(router_type, k, num_experts, None)
    with_bias = imbalance_over_training(router_type, k, num_experts, 0.01)
    assert min(without) > 2, "without the bias (and no balance loss) the skew stays"
    assert with_bias[0] > 2 and min(with_bias) < 1.3, with_bias[::10]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(router_type="sigmoid", k=1), "with k=1 every gate is 1 and the router never learns"),
        (dict(shared_expert_count=-1), "the shared expert count must be an integer >= 0"),
        (dict(shared_expert_count=2, shared_expert_dim=0), "hidden size must be a positive integer"),
        (dict(balance_bias_rate=0.0), "the bias update rate must be a finite number > 0"),
        (dict(balance_bias_rate=float("nan")), "the bias update rate must be a finite number > 0"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    args = dict(model_dim=D, hidden_dim=H, num_experts=E, k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        MoELayerConfig.of(**args)
