"""Freezing parts of an MoE layer (moe/freeze.py) and the global-batch balance loss (moe/balance_scope.py),
without fairseq: which parameters each part holds, the refusals, the held balance bias, the estimator
against its definition, and the optimizer state carried over a changed freeze (training/frozen_resume.py).
"""

import pytest
import torch

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig
from fairseq_moe_ext.moe.balance_bias import update_balance_biases
from fairseq_moe_ext.moe.balance_scope import start_update
from fairseq_moe_ext.moe.freeze import freeze_parts, parse_frozen_parts
from fairseq_moe_ext.training.frozen_resume import remap_optimizer_state

D, H, E = 6, 8, 4


class Block(torch.nn.Module):
    """A shared projection in front of an MoE layer with shared experts and the balance bias."""

    def __init__(self, scope="micro-batch", **options):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(D, D)
        config = MoELayerConfig.of(D, H, E, k=2, balance_scope=scope, **options)
        self.moe = MoELayer(config)

    def forward(self, x):
        return self.moe(self.proj(x))


def test_parts_are_parsed_in_any_order_and_nothing_frozen_by_default():
    assert parse_frozen_parts(None) == frozenset() == parse_frozen_parts("")
    assert parse_frozen_parts("experts, router") == {"router", "experts"}


@pytest.mark.parametrize(
    "value, said",
    [("routers", "unknown part 'routers'"), ("router,experts,shared", "freezes every parameter, so nothing would")],
)
def test_an_unknown_part_or_freezing_every_part_is_refused_in_one_line(value, said):
    with pytest.raises(ValueError) as refused:
        parse_frozen_parts(value, "--moe-freeze")
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"--moe-freeze {value}") and said in line, line


def frozen_names(block):
    return {name for name, p in block.named_parameters() if not p.requires_grad}


def test_each_part_freezes_its_parameters_and_shared_takes_the_shared_experts():
    names = {name for name, _ in Block(shared_expert_count=1).named_parameters()}
    router = {n for n in names if ".router." in n}
    experts = {n for n in names if n.startswith("moe.experts.")}
    assert router and experts and any(".shared_experts." in n for n in names)
    for parts, want in [
        ("router", router),
        ("experts", experts),
        ("shared", names - router - experts),
        ("router,shared", names - experts),
    ]:
        block = Block(shared_expert_count=1)
        counts = freeze_parts(block, parse_frozen_parts(parts))
        assert frozen_names(block) == want, parts
        assert sum(counts.values()) == sum(p.numel() for n, p in block.named_parameters() if n in want)


def test_a_frozen_router_holds_its_balance_bias_while_a_trained_one_moves_it():
    moved = {}
    for parts in ("", "router"):
        block = Block(balance_bias_rate=0.1)
        freeze_parts(block, parse_frozen_parts(parts))
        block(torch.randn(5, D))
        update_balance_biases(block)
        moved[parts] = block.moe.router.balance_bias.bias.abs().max().item()
    assert moved[""] > 0 and moved["router"] == 0.0


def balance_of(layer, x):
    return layer.forward_with_aux(x)[1].balance_loss


def first_choice_counts(layer, x):
    with torch.no_grad():
        index = layer.router(x).expert_index[:, 0]
    return torch.bincount(index, minlength=E).double()


def test_one_micro_batch_gives_the_micro_batch_scopes_balance_loss_bit_for_bit():
    x = torch.randn(9, D)
    micro, whole = Block("micro-batch").moe, Block("global-batch").moe
    micro.load_state_dict(whole.state_dict())
    assert torch.equal(balance_of(micro, x), balance_of(whole, x))


def test_the_second_micro_batch_weighs_its_probabilities_by_the_counts_of_both():
    """Micro-batch 2 of an update: E * sum_e P_e(batch 2) * (c_e(1) + c_e(2)) / (n1 + n2); an update started
    afresh counts batch 2 alone (the micro-batch value)."""
    layer = Block("global-batch").moe
    torch.manual_seed(1)
    first, second = torch.randn(7, D), torch.randn(5, D)
    start_update(layer)
    balance_of(layer, first)
    got = balance_of(layer, second)
    with torch.no_grad():
        mean_prob = layer.router(second).probs.double().mean(0)
    counts = first_choice_counts(layer, first) + first_choice_counts(layer, second)
    want = E * torch.sum(mean_prob * counts / 12)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    start_update(layer)
    micro = Block("micro-batch").moe
    micro.load_state_dict(layer.state_dict())
    assert torch.equal(balance_of(layer, second), balance_of(micro, second))
    assert not torch.equal(got, balance_of(micro, second)), "the case should tell the scopes apart"


def test_evaluation_counts_nothing_and_uses_the_micro_batch_value():
    layer = Block("global-batch").moe
    balance_of(layer, torch.randn(7, D))
    counted = layer.update_load.counts.clone()
    layer.eval()
    balance_of(layer, torch.randn(4, D))
    assert torch.equal(layer.update_load.counts, counted)


def test_the_optimizer_state_follows_each_parameter_across_a_changed_freeze():
    # Five parameters; trained before: 0, 1, 3 (saved as 0, 1, 2); trained now: 1, 2, 3.
    saved = {
        "state": {0: {"m": "p0"}, 1: {"m": "p1"}, 2: {"m": "p3"}},
        "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}],
        "loss_scale": 8.0,
    }
    remapped = remap_optimizer_state(saved, [1, 1, 0, 1, 0], [0, 1, 1, 1, 0])
    assert remapped["state"] == {0: {"m": "p1"}, 2: {"m": "p3"}} and remapped["_kept"] == 2
    assert remapped["param_groups"] == [{"lr": 0.1, "params": [0, 1, 2]}] and remapped["loss_scale"] == 8.0
    assert remap_optimizer_state(saved, [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]) is None  # not the saved layout
