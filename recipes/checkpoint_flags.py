"""The fairseq-train flags that rebuild a checkpoint's model: its shape and MoE options, from its cfg.

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

# fmt: off
VALUED = ("encoder_layers", "decoder_layers", "encoder_embed_dim", "decoder_embed_dim", "encoder_ffn_embed_dim",
          "decoder_ffn_embed_dim", "encoder_attention_heads", "decoder_attention_heads", "max_source_positions",
          "max_target_positions", "activation_fn", "moe_expert_count", "moe_freq", "encoder_moe_freq",
          "decoder_moe_freq", "moe_top_k", "moe_expert_ffn_dim", "moe_capacity_factor", "moe_eval_capacity_factor",
          "moe_eom", "moe_eval_capacity_token_fraction", "moe_second_expert_policy", "moe_normalize_expert_grad")
# fmt: on
# fmt: off
SWITCHES = ("encoder_normalize_before", "decoder_normalize_before", "share_all_embeddings",
            "share_decoder_input_output_embed", "encoder_learned_pos", "decoder_learned_pos", "layernorm_embedding",
            "no_scale_embedding", "no_token_positional_embeddings", "moe_normalize_gate", "moe_gating_use_fp32",
            "moe_batch_prioritized_routing", "moe_normalize_gate_after_dropping", "moe_batch_major_routing")
# fmt: on


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
    for name in VALUED:
        if options.get(name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(options[name])]
    flags += [f"--{name.replace('_', '-')}" for name in SWITCHES if options.get(name)]
    return flags


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    print(" ".join(model_flags(sys.argv[1])))
