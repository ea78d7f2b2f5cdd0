"""The fairseq-train flags that rebuild a checkpoint's model: its shape and MoE options, from its cfg (and the
criterion's gate-loss combination it records).

fairseq-train builds the model from its command line, also when it restores weights with
``--restore-file``; a fine-tuning run must therefore repeat the checkpoint's architecture. This prints
it, one line, from the checkpoint's own options (read through the restricted unpickler): a single
file, or a set's rank 0 file (``<name>-rank-0-of-W.pt`` for ``<name>.pt``).

    python recipes/checkpoint_flags.py imported/model.pt
"""

import glob
import os
import sys

from fairseq_moe_ext.checkpoint.safe_load import safe_load
from fairseq_moe_ext.training.resume_policy import MAY_CHANGE, POLICY

# fairseq's own shape options: what a fine-tuning run must repeat besides the MoE ones.
# fmt: off
SHAPE = ("encoder_layers", "decoder_layers", "encoder_embed_dim", "decoder_embed_dim", "encoder_ffn_embed_dim",
         "decoder_ffn_embed_dim", "encoder_attention_heads", "decoder_attention_heads", "max_source_positions",
         "max_target_positions", "encoder_normalize_before", "decoder_normalize_before", "share_all_embeddings",
         "share_decoder_input_output_embed", "encoder_learned_pos", "decoder_learned_pos", "layernorm_embedding",
         "no_scale_embedding", "no_token_positional_embeddings")
# fmt: on
# Every model option that the resume policy says the weights were made for (other parameters, or another
# function of the same ones: router, top-k, gates, activation): derived, so that a new one is never missed.
MADE_FOR = tuple(name for name, rule in POLICY.items() if rule.section == "model" and rule.kind != MAY_CHANGE)
# Options a run may change, carried over so that fine-tuning starts as the checkpoint was trained: its
# capacities and slot dropping, its expert-gradient scaling, the moe branch's fp32-router flag.
# fmt: off
CARRIED_OVER = ("moe_capacity_factor", "moe_eval_capacity_factor", "moe_eval_capacity_token_fraction",
                "moe_batch_prioritized_routing", "moe_batch_major_routing", "moe_normalize_expert_grad",
                "moe_gating_use_fp32")
# fmt: on


# The criterion options a checkpoint records that a fine-tuning run repeats: how the MoE layers' gate losses are
# combined (NLLB-200 MoE: summed, where this project's default averages). The loss weights are the run's choice.
CRITERION = ("moe_gate_loss_combine_method",)


def spelled(name, value):
    """The command-line flags that set option ``name`` to ``value``: a switch only when true."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else []
    return [] if value is None else [flag, str(value)]


def checkpoint_file(path):
    if os.path.isfile(path):
        return path
    ranks = sorted(glob.glob(glob.escape(path[:-3] if path.endswith(".pt") else path) + "-rank-0-of-*.pt"))
    if not ranks:
        raise SystemExit(f"{path}: no such checkpoint file or set (expected {path} or its -rank-0-of-W.pt)")
    return ranks[0]


def model_flags(path):
    state = safe_load(checkpoint_file(path))
    options = (state.get("cfg") or {}).get("model") or state.get("args")
    options = options if isinstance(options, dict) else vars(options)
    flags = []
    for name in (*SHAPE, *MADE_FOR, *CARRIED_OVER):
        flags += spelled(name, options.get(name))
    criterion = (state.get("cfg") or {}).get("criterion") or {}
    for name in CRITERION:
        flags += spelled(name, criterion.get(name) if isinstance(criterion, dict) else getattr(criterion, name, None))
    return flags


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    print(" ".join(model_flags(sys.argv[1])))
