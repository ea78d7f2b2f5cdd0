"""A router type is one scorer and one row of ``moe.scorers.SCORERS`` (docs/architecture.md)."""

import pytest
import torch

from fairseq_moe_ext.moe import RoutingConfig, TopKRouter
from fairseq_moe_ext.moe.layer_config import ROUTER_TYPES
from fairseq_moe_ext.moe.scorers import SCORERS, LinearScorer

D, E = 8, 4


class HalfTemperatureScorer(LinearScorer):
    summary = "linear logits over 2, softmax"

    def logits(self, router, x):
        return super().logits(router, x) / 2


def test_router_types_are_the_scorer_registry_names_in_order():
    assert ROUTER_TYPES == tuple(SCORERS) == ("top", "cosine", "sigmoid")


def test_a_registered_scorer_routes_with_its_own_logits_and_the_router_parameter_keys(monkeypatch):
    monkeypatch.setitem(SCORERS, "soft", HalfTemperatureScorer())
    torch.manual_seed(0)
    soft = TopKRouter(D, E, RoutingConfig(k=2, router_type="soft"))
    top = TopKRouter(D, E, RoutingConfig(k=2, router_type="top"))
    top.load_state_dict(soft.state_dict())  # the same keys as the top router's: router.wg.weight
    x = torch.randn(6, D)
    routed, reference = soft(x), top(x)
    assert torch.equal(routed.logits, reference.logits / 2)
    assert torch.equal(routed.probs, torch.softmax(reference.logits / 2, dim=-1))
    assert torch.equal(routed.gates, routed.probs.gather(1, routed.expert_index))


def test_a_scorer_normalising_over_the_chosen_experts_is_refused_with_k_1(monkeypatch):
    class Normalised(HalfTemperatureScorer):
        gates_normalised_over_chosen = True

    monkeypatch.setitem(SCORERS, "soft", Normalised())
    with pytest.raises(ValueError, match="soft normalises the gates over the chosen experts"):
        RoutingConfig(k=1, router_type="soft")
    assert RoutingConfig(k=2, router_type="soft").router_type == "soft"
