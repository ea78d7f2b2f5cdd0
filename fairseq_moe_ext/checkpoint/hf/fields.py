"""What import-hf checks of an NllbMoe ``config.json`` before anything is read or written, each refused in one line
naming the file and the field: the model it describes (``model_type``, ``architectures``), and the numeric fields
it reads, each there (where NllbMoe has no default), a number, and within its range (``RANGES``: a size at least 1
and at most a few times the largest real model's, a probability within 0..1)."""

import math
from typing import Dict

from ..errors import CheckpointSetError

# NllbMoeConfig's fields without a default here (hf_config.HF_DEFAULTS): a config.json must hold them.
REQUIRED_INTEGERS = ("d_model", "num_experts", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                     "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim")  # fmt: skip
OPTIONAL_INTEGERS = ("max_position_embeddings", "encoder_sparse_step", "decoder_sparse_step", "expert_capacity")
OPTIONAL_NUMBERS = ("dropout", "attention_dropout", "activation_dropout", "encoder_layerdrop", "decoder_layerdrop",
                    "moe_eval_capacity_token_fraction", "moe_token_dropout")  # fmt: skip
# (lowest, highest) of each field, sized from the largest real models with room: width 2**16 (PaLM's 18,432),
# layers 2**10 (about 100), heads 2**12 (128), FFN width 2**20 (PaLM's 73,728), experts 2**20 (PEER's
# 1,048,576), positions 2**24 (10M-token contexts), a capacity of 2**40 tokens; rates are probabilities.
SIZES = {"d_model": 2**16, "num_experts": 2**20, "encoder_layers": 2**10, "decoder_layers": 2**10,
         "encoder_attention_heads": 2**12, "decoder_attention_heads": 2**12, "encoder_ffn_dim": 2**20,
         "decoder_ffn_dim": 2**20, "max_position_embeddings": 2**24, "expert_capacity": 2**40}  # fmt: skip
RANGES = {
    **{name: (1, high) for name, high in SIZES.items()},
    **{f"{side}_sparse_step": (0, 2**10) for side in ("encoder", "decoder")},  # 0: no sparse layer on that side
    **{name: (0, 1) for name in OPTIONAL_NUMBERS if name.endswith(("dropout", "layerdrop"))},
    "moe_token_dropout": (0, 0.999999),  # --moe-eom's range: a masking rate below 1
    "moe_eval_capacity_token_fraction": (-math.inf, math.inf),  # <= 0: the training capacity; >= 1: dropless
}


# transformers' NllbMoeConfig.model_type; "nllb_moe" (its module's name) is accepted on import too.
MODEL_TYPE = "nllb-moe"
# The NllbMoe classes whose weights import-hf reads: the base model (the hub's facebook/nllb-moe-54b, saved by
# transformers' converter) and the one with the language-model head (save_pretrained of the usual class).
ARCHITECTURES = ("NllbMoeModel", "NllbMoeForConditionalGeneration")


def check_model_kind(config: Dict, path: str) -> None:
    if config.get("model_type") not in (MODEL_TYPE, "nllb_moe"):
        raise CheckpointSetError(
            f"{path} has model_type {config.get('model_type')!r}: import-hf reads Hugging Face "
            f"NLLB-MoE checkpoints (model_type {MODEL_TYPE!r}) only (nothing was written)"
        )
    architectures = config.get("architectures")
    if architectures is not None and (
        not isinstance(architectures, list) or not architectures or set(architectures) - set(ARCHITECTURES)
    ):
        raise CheckpointSetError(
            f"{path} has architectures {architectures!r}: import-hf reads the weights of "
            f"{' or '.join(ARCHITECTURES)} (nothing was written)"
        )


def check_numeric_fields(config: Dict, path: str) -> None:
    """``config`` as read from ``path`` (before NllbMoe's defaults are filled in)."""
    for name in REQUIRED_INTEGERS:
        if config.get(name) is None:
            raise CheckpointSetError(
                f"{path} has no {name}: NllbMoe's config.json holds it (an integer); add it, or export the "
                f"config again with transformers' save_pretrained (nothing was written)"
            )
    fields = [(n, True) for n in REQUIRED_INTEGERS + OPTIONAL_INTEGERS] + [(n, False) for n in OPTIONAL_NUMBERS]
    for name, integer in fields:
        value = config.get(name)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (integer and not float(value).is_integer()) or value != value or abs(value) == float("inf"):
            raise CheckpointSetError(
                f"{path}: {name} is {value!r}, not {'an integer' if integer else 'a number'}: write it as one in "
                f"config.json (nothing was written)"
            )
        low, high = RANGES[name]
        if not low <= value <= high:
            kind, limit = ("an integer", high) if integer else ("a number", f"{high:g}")
            raise CheckpointSetError(
                f"{path}: {name} is {value!r}, outside its range: write {kind} from {low} to {limit} in config.json, "
                f"the value the model was trained with (nothing was written)"
            )
