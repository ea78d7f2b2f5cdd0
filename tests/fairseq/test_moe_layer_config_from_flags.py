"""The MoE layer flags reach every MoE layer through one function (``models/moe_layers.py``'s
``moe_layer_config``): a model built the way fairseq-train builds it holds, in each MoE layer, the
config these flags describe, written out here field by field; and the model records the expert
layout it was built for, which the fairseq hooks read from it."""

import pytest

from fairseq import utils
from fairseq_moe_ext.moe import MoELayer, MoELayerConfig, RoutingConfig
from fairseq_moe_ext.moe.expert_layout import ExpertLayout
from support.inputs.tiny_fairseq_models import language_model, translation

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")

# Every layer flag away from its default (and both capacity factors of different signs).
# fmt: off
FLAGS = ["--moe-expert-count", "4", "--moe-top-k", "3", "--moe-capacity-factor", "1.5",
         "--moe-eval-capacity-factor", "-2", "--moe-router", "sigmoid", "--moe-gating-no-fp32",
         "--moe-gate-noise", "0.25", "--moe-normalize-gate", "--moe-batch-prioritized-routing",
         "--moe-balance", "bias", "--moe-bias-update-rate", "0.01", "--moe-expert-ffn-dim", "48",
         "--moe-shared-expert-count", "2", "--moe-shared-expert-ffn-dim", "24", "--moe-eom", "0.2",
         "--activation-fn", "gelu", "--activation-dropout", "0.1"]
# fmt: on
ROUTING = RoutingConfig(
    k=3,
    router_type="sigmoid",
    fp32=False,
    gate_noise=0.25,
    normalize_gates=True,
    batch_prioritized=True,
    balance_bias_rate=0.01,
)


def layer_configs(model):
    return [m.config for m in model.modules() if isinstance(m, MoELayer)]


def test_every_moe_layer_flag_lands_in_each_moe_layer_s_config(data):
    configs = layer_configs(language_model(data, *FLAGS).model)
    want = MoELayerConfig(
        64,
        48,
        4,
        routing=ROUTING,
        capacity_factor=1.5,
        eval_capacity_factor=-2.0,
        activation=utils.get_activation_fn("gelu"),
        activation_dropout=0.1,
        shared_expert_count=2,
        shared_expert_dim=24,
        expert_output_masking=0.2,
    )
    assert configs == [want]


def test_without_the_optional_flags_the_experts_take_the_dense_ffn_size_and_the_defaults(data):
    configs = layer_configs(translation(data, "--moe-expert-count", "2", "--moe-freq", "1").model)
    want = MoELayerConfig(64, 128, 2, activation=utils.get_activation_fn("relu"))
    assert configs == [want] * 4


def test_a_built_model_records_the_expert_layout_its_layers_were_built_for(data):
    model = language_model(data).model
    assert model.parallel_plan.layout == ExpertLayout(1, 1, 0)  # one process: every expert local
    assert {layer.parallel_size for layer in model.modules() if isinstance(layer, MoELayer)} == {1}
