"""Small checkpoints made in process, in the formats the plugin writes (no fairseq run needed)."""

from pathlib import Path

import torch

from fairseq_moe_ext import checkpoint as moe_ckpt

EXPERT_KEY = "encoder.layers.1.fc1.experts.batched_fc1_w"


def full_state(experts=4, updates=7):
    """What a single process holding every expert saves (a fairseq checkpoint with MoE metadata)."""
    torch.manual_seed(0)
    model = {EXPERT_KEY: torch.randn(experts, 2, 3), "encoder.embed_tokens.weight": torch.randn(5, 3)}
    names = ["encoder.embed_tokens.weight", EXPERT_KEY]
    state = {
        "model": model,
        "optimizer_history": [
            {
                "num_updates": updates,
                "optimizer_name": "Adam",
                "criterion_name": "x",
                "lr_scheduler_state": {"best": 1.0},
            }
        ],
        "last_optimizer_state": {
            "state": {0: {"exp_avg": torch.zeros(5, 3)}, 1: {"exp_avg": torch.ones(experts, 2, 3)}},
            "param_groups": [{"params": [0, 1]}],
        },
        "extra_state": {"epoch": 1},
    }
    state["moe"] = moe_ckpt.moe_metadata(names, [EXPERT_KEY], 1, 0, updates, experts_per_worker=experts)
    return state


def fingerprint(directory: Path):
    return (
        {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))}
        if directory.exists()
        else None
    )


NOT_CHECKPOINTS = {"a-dict": {"a": 1}, "a-tensor": torch.zeros(3), "a-list": [1, 2]}
