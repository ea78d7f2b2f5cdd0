"""recipes/model_cost.py and the main job summary's equal-compute verdict (recipes/summarize_translation.py)."""

import sys

import pytest
import torch

from support.launch.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "recipes"))
from model_cost import model_cost  # noqa: E402
from routing_extensions import effect_lines  # noqa: E402
from summarize_translation import comparisons  # noqa: E402

D, H, E, K = 64, 128, 8, 2


def moe_ffn(prefix: str) -> dict:
    return {
        f"{prefix}.batched_fc1_w": torch.zeros(E, H, D),
        f"{prefix}.batched_fc1_b": torch.zeros(E, H),
        f"{prefix}.batched_fc2_w": torch.zeros(E, D, H),
        f"{prefix}.batched_fc2_b": torch.zeros(E, D),
    }


def dense_ffn(prefix: str, hidden: int) -> dict:
    return {
        f"{prefix}.fc1.weight": torch.zeros(hidden, D),
        f"{prefix}.fc1.bias": torch.zeros(hidden),
        f"{prefix}.fc2.weight": torch.zeros(D, hidden),
        f"{prefix}.fc2.bias": torch.zeros(D),
    }


def test_active_parameters_and_flops_count_k_of_e_experts_and_the_total_all_e():
    tensors = moe_ffn("encoder.layers.0.moe")
    cost = model_cost(tensors, set(tensors), E, K)
    expert_elements = 2 * E * H * D + E * (H + D)
    assert cost["total"] == expert_elements
    assert cost["active"] == expert_elements * K // E
    assert cost["encoder_flops"] == 2 * (2 * K * H * D)  # two matrices per expert, k experts, 2 FLOPs each
    assert cost["decoder_flops"] == 0


def test_shared_experts_count_fully_in_active_cost_as_a_dense_ffn_of_their_width():
    routed = moe_ffn("encoder.layers.0.fc1.experts")
    prefix = "encoder.layers.0.fc1.shared_experts.ffn"  # 2 shared experts of width H, stored as one of 2H
    shared = {
        f"{prefix}.batched_fc1_w": torch.zeros(1, 2 * H, D),
        f"{prefix}.batched_fc1_b": torch.zeros(1, 2 * H),
        f"{prefix}.batched_fc2_w": torch.zeros(1, D, 2 * H),
        f"{prefix}.batched_fc2_b": torch.zeros(1, D),
    }
    without = model_cost(routed, set(routed), E, K)
    cost = model_cost({**routed, **shared}, set(routed), E, K)
    dense = model_cost(dense_ffn("encoder.layers.0", 2 * H), set(), None, None)
    assert cost["active"] - without["active"] == dense["active"]
    assert cost["encoder_flops"] - without["encoder_flops"] == dense["encoder_flops"] == 2 * 2 * (2 * H * D)


def test_embeddings_biases_and_layer_norms_count_as_parameters_but_cost_no_flops():
    tensors = {
        "encoder.embed_tokens.weight": torch.zeros(100, D),
        "decoder.embed_positions.weight": torch.zeros(50, D),
        "encoder.layers.0.self_attn_layer_norm.weight": torch.zeros(D),
        "decoder.layers.0.self_attn.q_proj.weight": torch.zeros(D, D),
        "decoder.layers.0.self_attn.q_proj.bias": torch.zeros(D),
        "decoder.output_projection.weight": torch.zeros(100, D),
    }
    cost = model_cost(tensors, set(), None, None)
    assert cost["total"] == cost["active"] == sum(t.numel() for t in tensors.values())
    assert cost["encoder_flops"] == 0
    assert cost["decoder_flops"] == 2 * (D * D + 100 * D)


def test_a_dense_ffn_k_times_the_expert_width_costs_what_the_moe_layer_does_per_token():
    moe = {**moe_ffn("decoder.layers.1.moe"), "decoder.layers.1.moe.router.wg.weight": torch.zeros(E, D)}
    expert_keys = {key for key in moe if ".batched_" in key}
    moe_cost = model_cost(moe, expert_keys, E, K)
    matched = model_cost(dense_ffn("decoder.layers.1", K * H), set(), None, None)
    same_hidden = model_cost(dense_ffn("decoder.layers.1", H), set(), None, None)
    router_flops = 2 * E * D
    assert moe_cost["decoder_flops"] == matched["decoder_flops"] + router_flops
    assert same_hidden["decoder_flops"] * K == matched["decoder_flops"]
    # Parameters also agree but for the router and the k - 1 extra fc2 biases of the k experts.
    assert moe_cost["active"] == matched["active"] + E * D + (K - 1) * D


def test_expert_tensors_without_an_expert_count_or_top_k_are_refused_naming_the_flags():
    tensors = moe_ffn("encoder.layers.0.moe")
    for experts, k in [(None, K), (E, None), (None, None)]:
        with pytest.raises(ValueError, match="--moe-expert-count and --moe-top-k"):
            model_cost(tensors, set(tensors), experts, k)


def run(name: str, bleu: float, flops: int) -> dict:
    return {"name": name, "bleu": {"bleu": bleu}, "flops": flops}


@pytest.mark.parametrize(
    "moe_bleu, dense_bleu, dense_flops, says",
    [
        (60.0, 55.0, 100, "the MoE beats a dense model with 100% of its FLOPs per token"),
        (60.0, 55.0, 130, "the MoE beats a dense model with 130% of its FLOPs per token"),
        (55.0, 60.0, 100, "the MoE does NOT beat a dense model with 100% of its FLOPs per token"),
        (55.0, 55.0, 110, "the MoE does NOT beat a dense model with 110% of its FLOPs per token"),
        (60.0, 55.0, 60, "the dense model spends only 60% of the MoE's FLOPs per token"),
        (50.0, 55.0, 60, "the dense model spends only 60% of the MoE's FLOPs per token"),
    ],
)
def test_the_summary_says_whether_the_moe_beat_a_dense_model_of_equal_or_more_compute(
    moe_bleu, dense_bleu, dense_flops, says
):
    (line,) = comparisons(run("MoE", moe_bleu, 100), [run("dense_matched", dense_bleu, dense_flops)])
    assert line.startswith(f"  MoE - dense_matched: {moe_bleu - dense_bleu:+.2f} BLEU; ")
    assert line.endswith(says) or says + ":" in line


def summary_run(name, bleu, imbalance, active, features):
    return {
        "name": name,
        "bleu": {"bleu": bleu},
        "active": active,
        "flops": 2 * active,
        "last": {"moe_imbalance": imbalance, "moe_gate_loss": 1.0},
        "features": features,
    }


def test_the_summary_says_what_shared_experts_and_bias_balancing_changed():
    with_them = summary_run(
        "MoE", 30.5, 1.12, 300, {"router": "sigmoid", "shared_experts": 1, "balance": "bias", "bias_spread": 0.0125}
    )
    base = summary_run(
        "moe_base", 30.0, 2.4, 250, {"router": "sigmoid", "shared_experts": 0, "balance": "none", "bias_spread": None}
    )
    text = "\n".join(effect_lines(with_them, base))
    assert (
        "MoE (router sigmoid, 1 shared expert(s), loss-free bias balancing (final bias spread 0.0125)) vs "
        "moe_base (router sigmoid, no shared experts)" in text
    )
    assert "+0.50 BLEU; imbalance over the last log interval 1.12 vs 2.4" in text
    assert "active parameters per token 300 vs 250; FLOPs per token 600 vs 500" in text
