"""Specification of the fairseq-free MoE core (fairseq_moe_ext.moe)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fairseq_moe_ext.moe import (
    BatchedExperts,
    MoEAuxCache,
    MoELayer,
    MoELayerConfig,
    RoutingConfig,
    TopKRouter,
    UncollectedMoELossError,
    balance_loss,
    expert_capacity,
    z_loss,
)
from fairseq_moe_ext.moe.capacity import slots_within_capacity
from fairseq_moe_ext.moe.reference import assert_layer_matches_reference, reference_moe

D, H, E = 12, 20, 4


def make_layer(k=2, cf=0.0, cache=None, name="moe", **kw):
    kw.setdefault("eval_capacity_factor", cf)
    return MoELayer(MoELayerConfig.of(D, H, E, k=k, capacity_factor=cf, **kw), cache=cache, name=name)


@pytest.mark.parametrize("k", [1, 2, E])
@pytest.mark.parametrize("cf", [0.0, 0.5, -0.75])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("prioritized", [False, True])
def test_layer_output_and_gradients_equal_a_per_token_reference(k, cf, padded, prioritized):
    layer = make_layer(k=k, cf=cf, batch_prioritized=prioritized, normalize_gates=(k == 2))
    x = torch.randn(3, 7, D, requires_grad=True)
    mask = None
    if padded:
        mask = torch.zeros(3, 7, dtype=torch.bool)
        mask[0, 4:] = True
        mask[2, 1:] = True
    y, aux, kept = assert_layer_matches_reference(layer, x, mask, torch.randn(3, 7, D))
    n_real = 21 - (0 if mask is None else int(mask.sum()))
    assert aux.stats["dropped_slots"].item() == n_real * k - len(kept)
    if cf != 0.0 and k > 1:
        assert len(kept) < n_real * k, "the test should exercise dropping"
    if padded:
        assert y[mask].abs().max() == 0


@pytest.mark.parametrize(
    "cf, expected",
    [(1.0, 50), (1.25, 62), (0.0, None), (-1.0, 50), (-100.0, 5000)],
)
def test_capacity_follows_tutel_semantics(cf, expected):
    # N=100 tokens, E=4 experts, k=2: ceil(100/4) = 25 tokens per expert.
    assert expert_capacity(100, 4, 2, cf) == expected


def test_dropped_slots_get_zero_output_and_are_counted():
    layer = make_layer(k=1, cf=0.25)  # capacity 1 * int(0.25 * ceil(16/4)) = 1 slot per expert
    x = torch.randn(16, D)
    y, aux = layer.forward_with_aux(x)
    served = (y.abs().sum(-1) > 0).sum().item()
    assert served <= E
    assert aux.stats["dropped_slots"].item() == 16 - served


def test_first_choices_are_served_before_any_second_choice():
    layer = make_layer(k=2, cf=0.5)  # capacity 2 * int(0.5 * 2) = 2 per expert for 8 tokens
    with torch.no_grad():
        layer.router.wg.weight.zero_()
        layer.router.wg.weight[0, 0] = 10.0
        layer.router.wg.weight[1, 1] = 10.0
    # Tokens 0-3 pick expert 1 then 0, tokens 4-7 expert 0 then 1: in batch order, tokens 0 and 1's
    # second choices reach expert 0 before tokens 4 and 5's first choices, and must still lose.
    x = torch.zeros(8, D)
    x[:4, 0], x[:4, 1] = 0.5, 1.0
    x[4:, 0], x[4:, 1] = 1.0, 0.5
    x[:, 2:] = torch.randn(8, D - 2) * 0.01  # distinct tokens (the router ignores these features)
    first_choices_that_fit = {(0, 0), (1, 0), (4, 0), (5, 0)}
    _, kept = reference_moe(layer, x)
    assert kept == first_choices_that_fit

    routing = layer.router(x)
    assert routing.expert_index.tolist() == [[1, 0]] * 4 + [[0, 1]] * 4
    keep = slots_within_capacity(routing.expert_index, E, expert_capacity(8, E, 2, 0.5))
    assert {(t, j) for t, j in keep.nonzero().tolist()} == first_choices_that_fit
    y, aux = layer.forward_with_aux(x)
    assert aux.stats["dropped_slots"].item() == 12
    y_ref, _ = reference_moe(layer, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    served = (y.abs().sum(-1) > 0).nonzero().squeeze(1).tolist()
    assert served == [0, 1, 4, 5]
    for t in served:  # only the first choice reaches the output
        first = routing.expert_index[t, 0].item()
        ex = layer.experts
        hidden = F.relu(F.linear(x[t], ex.batched_fc1_w[first], ex.batched_fc1_b[first]))
        expert_alone = F.linear(hidden, ex.batched_fc2_w[first], ex.batched_fc2_b[first])
        torch.testing.assert_close(y[t], routing.gates[t, 0] * expert_alone, rtol=1e-5, atol=1e-6)


def collapse_router(layer, scale=50.0):
    with torch.no_grad():
        layer.router.wg.weight.copy_(torch.eye(E, D) * scale)


def test_balance_loss_is_one_when_balanced_and_num_experts_when_collapsed():
    layer = make_layer(k=1)
    collapse_router(layer)
    balanced = torch.eye(E, D).repeat(5, 1)  # each expert's own direction, equally often
    _, aux = layer.forward_with_aux(balanced)
    assert aux.balance_loss.item() == pytest.approx(1.0, abs=1e-6)
    collapsed = torch.eye(E, D)[:1].repeat(20, 1)
    _, aux = layer.forward_with_aux(collapsed)
    assert aux.balance_loss.item() == pytest.approx(float(E), abs=1e-6)
    # The same formula straight from its definition.
    assert balance_loss(torch.tensor([10.0, 0, 0, 0]), torch.tensor([10, 0, 0, 0]), torch.tensor(10)).item() == 4.0


def test_z_loss_is_mean_squared_logsumexp_of_router_logits():
    layer = make_layer(k=2)
    x = torch.randn(9, D)
    _, aux = layer.forward_with_aux(x)
    logits = x @ layer.router.wg.weight.t()
    torch.testing.assert_close(aux.z_loss, torch.logsumexp(logits, -1).pow(2).mean())
    assert z_loss(torch.tensor(8.0), torch.tensor(4)).item() == 2.0


def test_balance_loss_gradient_reaches_the_router():
    layer = make_layer(k=2)
    x = torch.randn(10, D)
    _, aux = layer.forward_with_aux(x)
    aux.balance_loss.backward()
    assert layer.router.wg.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("router_type", ["top", "cosine"])
def test_router_math_is_fp32_when_inputs_are_bf16(router_type):
    router = TopKRouter(D, E, RoutingConfig(k=2, router_type=router_type, fp32=True)).to(torch.bfloat16)
    x = torch.randn(6, D, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = router(x)
    assert routing.logits.dtype == torch.float32
    assert routing.probs.dtype == torch.float32
    assert routing.gates.dtype == torch.float32
    layer = make_layer(k=2).to(torch.bfloat16)
    y, aux = layer.forward_with_aux(torch.randn(5, D, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and aux.balance_loss.dtype == torch.float32


def test_cosine_router_scores_are_scaled_cosine_similarities_with_clamped_temperature():
    router = TopKRouter(D, E, RoutingConfig(k=1, router_type="cosine"), cosine_proj_dim=8)
    with torch.no_grad():
        router.temperature.fill_(10.0)  # exp(10) would exceed the clamp at 100
    x = torch.randn(5, D)
    logits = router.compute_logits(x)
    h = F.normalize(router.cosine_projector(x), dim=-1)
    sim = F.normalize(router.sim_matrix, dim=0)
    torch.testing.assert_close(logits, h @ sim * 100.0)
    assert logits.abs().max() <= 100.0 + 1e-4


def test_gate_noise_changes_choices_only_in_training():
    router = TopKRouter(D, E, RoutingConfig(k=1, gate_noise=50.0))
    x = torch.randn(200, D)
    router.eval()
    a, b = router(x).expert_index, router(x).expert_index
    assert torch.equal(a, b)
    router.train()
    assert not torch.equal(router(x).expert_index, a)


def test_normalized_gates_sum_to_one():
    router = TopKRouter(D, E, RoutingConfig(k=2, normalize_gates=True))
    gates = router(torch.randn(7, D)).gates
    torch.testing.assert_close(gates.sum(-1), torch.ones(7))


def test_experts_apply_the_configured_activation():
    layer = make_layer(k=1, activation="gelu")
    x = torch.randn(6, D)
    torch.testing.assert_close(layer(x), reference_moe(layer, x, activation=F.gelu)[0])
    assert not torch.allclose(layer(x), reference_moe(layer, x, activation=F.relu)[0])


def test_experts_start_distinct_and_depend_only_on_their_global_id():
    all_local = BatchedExperts(D, H, 4, first_global_id=0, seed=7)
    upper_half = BatchedExperts(D, H, 2, first_global_id=2, seed=7)
    torch.testing.assert_close(all_local.batched_fc1_w[2:], upper_half.batched_fc1_w, rtol=0, atol=0)
    torch.testing.assert_close(all_local.batched_fc2_b[2:], upper_half.batched_fc2_b, rtol=0, atol=0)
    w = all_local.batched_fc1_w
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(w[i], w[j])
    other_seed = BatchedExperts(D, H, 4, seed=8)
    assert not torch.equal(other_seed.batched_fc1_w, w)


def test_expert_initialisation_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    BatchedExperts(D, H, 2, first_global_id=0)
    after_two = torch.rand(4)
    torch.manual_seed(3)
    BatchedExperts(D, H, 8, first_global_id=0)
    after_eight = torch.rand(4)
    assert torch.equal(after_two, expected) and torch.equal(after_eight, expected)


def test_expert_parameters_are_marked_for_fairseq():
    layer = make_layer()
    expert = {n for n, p in layer.named_parameters() if getattr(p, "expert", False)}
    assert expert == {n for n, _ in layer.named_parameters() if n.startswith("experts.")}
    assert not getattr(layer.router.wg.weight, "expert", False)


class TwoLayers(torch.nn.Module):
    def __init__(self, cache):
        super().__init__()
        self.a = make_layer(cache=cache, name="a")
        self.b = make_layer(cache=cache, name="b")

    def forward(self, x):
        return self.b(x + self.a(x))


def test_cache_returns_every_layer_of_one_forward_and_nothing_stale():
    cache = MoEAuxCache()
    model = TwoLayers(cache)
    with torch.no_grad():
        model(torch.randn(4, D))  # e.g. inference: never collected
    cache.start_pass()
    model(torch.randn(5, D))
    records = cache.collect()
    assert [r.layer for r in records] == ["a", "b"]
    assert all(r.aux.stats["num_tokens"].item() == 5 for r in records)
    assert cache.collect() == []


def test_a_layer_that_runs_twice_leaves_two_records():
    cache = MoEAuxCache()
    layer = make_layer(cache=cache, name="shared")
    layer(layer(torch.randn(3, D)))
    assert [r.layer for r in cache.collect()] == ["shared", "shared"]


def test_uncollected_training_losses_raise_instead_of_vanishing():
    cache = MoEAuxCache()
    model = TwoLayers(cache)
    model(torch.randn(3, D)).sum().backward()
    with pytest.raises(UncollectedMoELossError, match="moe_cross_entropy"):
        cache.start_pass()


def test_activation_checkpointing_neither_loses_nor_double_counts_losses():
    cache = MoEAuxCache()
    model = TwoLayers(cache)
    x = torch.randn(6, D)

    def step(use_checkpoint):
        model.zero_grad()
        cache.start_pass()
        y = checkpoint(model, x, use_reentrant=False) if use_checkpoint else model(x)
        records = cache.collect()
        loss = y.sum() + sum(r.aux.balance_loss + r.aux.z_loss for r in records)
        loss.backward()
        assert len(cache) == 0, "recomputation in backward must not leave records"
        return len(records), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_count, plain = step(False)
    ckpt_count, ckpt = step(True)
    assert plain_count == ckpt_count == 2
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], msg=name)


def test_a_batch_of_only_padding_gives_zero_output_and_finite_losses():
    layer = make_layer(k=2, cf=1.0)
    x = torch.randn(2, 3, D, requires_grad=True)
    y, aux = layer.forward_with_aux(x, torch.ones(2, 3, dtype=torch.bool))
    assert y.abs().sum() == 0
    assert torch.isfinite(aux.balance_loss) and torch.isfinite(aux.z_loss)
    (y.sum() + aux.balance_loss).backward()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k=5), "k=5 exceeds num_experts=4: use k <= 4"),
        (dict(k=0), "top-k must be an integer >= 1"),
        (dict(num_experts=0), "num_experts must be a positive integer"),
        (dict(num_experts=-2), "num_experts must be a positive integer"),
        (dict(capacity_factor=float("nan")), "capacity_factor must be finite"),
        (dict(eval_capacity_factor=float("inf")), "eval_capacity_factor must be finite"),
        (dict(capacity_factor="lots"), "capacity_factor must be a number"),
        (dict(router_type="hash"), "unknown router type 'hash'"),
        (dict(activation="swoosh"), "unknown activation 'swoosh'"),
        (dict(gate_noise=-1.0), "gate_noise must be a finite number >= 0"),
        (dict(hidden_dim=0), "hidden_dim must be a positive integer"),
        (dict(activation_dropout=1.5), r"activation_dropout must be in \[0, 1\)"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    args = dict(model_dim=D, hidden_dim=H, num_experts=E, k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        MoELayerConfig.of(**args)


def test_inputs_of_the_wrong_shape_raise_clear_errors():
    layer = make_layer()
    with pytest.raises(ValueError, match=r"expects input of shape \[\.\.\., 12\]"):
        layer(torch.randn(4, D + 1))
    with pytest.raises(ValueError, match=r"expects input of shape"):
        layer(torch.randn(D))
    with pytest.raises(ValueError, match="padding_mask shape"):
        layer(torch.randn(2, 3, D), torch.zeros(3, 2, dtype=torch.bool))
