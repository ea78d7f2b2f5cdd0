"""Model option namespaces built without fairseq's parser: every MoE model option at its record's
default, with the changes a test asks for, and the shape of a tiny translation model that the
Hugging Face export accepts (the options hf_config reads beside the MoE ones)."""

import argparse

from fairseq_moe_ext.options import MODEL_OPTIONS


def model_defaults(**changes) -> argparse.Namespace:
    return argparse.Namespace(**{**{o.name: o.default for o in MODEL_OPTIONS}, "activation_fn": "relu", **changes})


def exportable_options(**changes) -> argparse.Namespace:
    base = dict(arch="moe_transformer", share_all_embeddings=True, encoder_normalize_before=True,
                decoder_normalize_before=True, moe_normalize_gate=True, moe_capacity_factor=1.0)  # fmt: skip
    for side in ("encoder", "decoder"):
        base.update({f"{side}_embed_dim": 16, f"{side}_layers": 2, f"{side}_attention_heads": 2})
        base[f"{side}_ffn_embed_dim"] = 32
    return model_defaults(**{**base, **changes})
