"""One configuration object describes an MoE layer: every option with its default and its check
(``moe/layer_config.py``); the layer takes it whole, and nothing checks an option a second time."""

import dataclasses

import pytest
import torch

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig, RoutingConfig, capacity

D, H, E = 8, 16, 4


def test_flat_keywords_land_in_the_routing_or_the_layer_fields_by_their_names():
    flat = MoELayerConfig.of(
        D,
        H,
        E,
        k=1,
        router_type="cosine",
        fp32=False,
        gate_noise=0.5,
        normalize_gates=True,
        batch_prioritized=True,
        balance_bias_rate=0.01,
        capacity_factor=1.5,
        eval_capacity_factor=-2,
        activation="gelu",
        shared_expert_count=1,
        shared_expert_dim=6,
        expert_output_masking=0.2,
        activation_dropout=0.1,
        bias=False,
    )
    routing = RoutingConfig(
        k=1,
        router_type="cosine",
        fp32=False,
        gate_noise=0.5,
        normalize_gates=True,
        batch_prioritized=True,
        balance_bias_rate=0.01,
    )
    assert flat == MoELayerConfig(
        D,
        H,
        E,
        routing=routing,
        capacity_factor=1.5,
        eval_capacity_factor=-2.0,
        activation="gelu",
        shared_expert_count=1,
        shared_expert_dim=6,
        expert_output_masking=0.2,
        activation_dropout=0.1,
        bias=False,
    )


def test_an_unknown_layer_option_is_refused_with_its_name_and_where_the_options_are():
    with pytest.raises(TypeError, match=r"unknown MoE layer option 'fp32_router'.*moe/layer_config.py"):
        MoELayerConfig.of(D, H, E, fp32_router=False)


def test_the_layer_takes_a_config_and_says_how_to_build_one_when_given_anything_else():
    with pytest.raises(TypeError, match="MoELayer takes an MoELayerConfig, got int: build one with MoELayerConfig"):
        MoELayer(D)


def test_a_built_layer_reads_its_options_from_its_frozen_config():
    config = MoELayerConfig.of(
        D, H, E, k=1, capacity_factor=1.25, eval_capacity_factor=0.5, expert_output_masking=0.1, balance_bias_rate=0.01
    )
    layer = MoELayer(config)
    assert (layer.model_dim, layer.num_experts, layer.k) == (D, E, 1)
    assert (layer.capacity_factor, layer.eval_capacity_factor, layer.expert_output_masking) == (1.25, 0.5, 0.1)
    assert layer.router.k == 1 and layer.router.balance_bias.update_rate == 0.01
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer.config.routing.k = 2


def test_the_layer_owns_the_balance_bias_and_passes_it_to_the_router_under_its_old_state_key():
    layer = MoELayer(MoELayerConfig.of(D, H, E, k=1, balance_bias_rate=0.01))
    assert [key for key in layer.state_dict() if "balance_bias" in key] == ["router.balance_bias.bias"]
    assert layer.balance_bias is layer.router.balance_bias  # one module, in the router's place of the tree
    x = torch.randn(7, D)
    layer.balance_bias.bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))  # sends every token to expert 2
    layer(x)
    assert torch.equal(layer.balance_bias.pending_load, torch.tensor([0, 0, 7, 0]))
    assert torch.equal(layer.router(x, layer.balance_bias.bias).expert_index, torch.full((7, 1), 2))
    assert MoELayer(MoELayerConfig(D, H, E)).balance_bias is None


def test_capacity_factors_are_checked_when_configured_and_never_again_on_a_forward(monkeypatch):
    layer = MoELayer(MoELayerConfig(D, H, E, capacity_factor=0.5, eval_capacity_factor=-1.0))

    def checked_again(*args, **kwargs):
        raise AssertionError("the capacity factor was checked again after the config was built")

    monkeypatch.setattr(capacity, "check_capacity_factor", checked_again)
    x = torch.randn(3, 5, D)
    layer.train()(x)
    layer.eval()(x)


def test_an_integer_capacity_factor_becomes_the_float_a_flag_would_give():
    config = MoELayerConfig(D, H, E, capacity_factor=1, eval_capacity_factor=0)
    assert config == MoELayerConfig(D, H, E, capacity_factor=1.0, eval_capacity_factor=0.0)
    assert isinstance(config.capacity_factor, float) and isinstance(config.eval_capacity_factor, float)


def test_the_layer_calls_its_expert_parallel_size_parallel_size_and_nothing_world_size():
    layer = MoELayer(MoELayerConfig(D, H, E))  # one process: P = 1, every expert local
    assert (layer.parallel_size, layer.num_local_experts) == (1, E)
    assert not hasattr(layer, "world_size"), "world_size is W (ExpertLayout); the layer's group size is P"
