"""Floating-point precision in the Hugging Face exchange (``export-hf`` / ``import-hf`` ``--dtype``).

A set keeps the dtype it was saved in (a ``--fp16`` run's files are float16, NLLB-200 MoE's released
ones too; this project's optimizers keep fp32 masters elsewhere, so the checkpoint holds what the model
holds). ``export-hf`` writes the set's tensors as they are and names their one dtype in
``config.json``'s ``torch_dtype``; ``--dtype`` casts each tensor as it is streamed into a shard (the
pending shard holds the cast copies, never the model). ``import-hf`` keeps the dtype of the Hugging
Face files unless ``--dtype`` asks for another; fairseq casts into the model's own parameters when it
loads, so the stored dtype decides the values, not the precision the model runs in.

What is refused: a ``--dtype`` other than float32 / float16 / bfloat16; an export whose weights mix
dtypes (``torch_dtype`` names one) or are another dtype (float64: not checked against transformers here)
without ``--dtype``; an import of non-floating weights (a quantized checkpoint).
"""

from typing import Dict, Iterable, Optional, Tuple

import torch

from ..errors import CheckpointSetError

# fmt: off
CAST = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
# fmt: on
NAMES = {dtype: name for name, dtype in CAST.items()}


def cast_dtype(text: Optional[str], command: str) -> Optional[torch.dtype]:
    """``--dtype``'s value as a torch dtype; None keeps the input's."""
    if text is None:
        return None
    key = str(text).strip().lower().replace("torch.", "")
    key = ALIASES.get(key, key)
    if key not in CAST:
        raise CheckpointSetError(
            f"{command} --dtype {text!r} is not a dtype written here: give float32, float16 or bfloat16 (nothing "
            f"was written)"
        )
    return CAST[key]


def name_of(dtype: torch.dtype) -> str:
    return NAMES.get(dtype, str(dtype).replace("torch.", ""))


def export_dtype(tensors: Iterable[Tuple[str, torch.Tensor]], path: str, cast: Optional[torch.dtype]) -> torch.dtype:
    """The dtype the export writes: ``cast``, or the one dtype of rank 0's weights (checked)."""
    if cast is not None:
        return cast
    first: Dict[torch.dtype, str] = {}
    for name, tensor in tensors:
        first.setdefault(tensor.dtype, name)
    if len(first) > 1:
        kinds = sorted(first, key=name_of)
        raise CheckpointSetError(
            f"{path} holds {' and '.join(name_of(d) for d in kinds)} weights ({first[kinds[0]]} is "
            f"{name_of(kinds[0])}, {first[kinds[1]]} {name_of(kinds[1])}), but config.json's torch_dtype names one "
            f"dtype: export with --dtype float32, float16 or bfloat16 (nothing was written)"
        )
    dtype = next(iter(first), torch.float32)
    if dtype not in NAMES:
        raise CheckpointSetError(
            f"{path} holds {name_of(dtype)} weights ({first[dtype]}): export-hf writes float32, float16 or "
            f"bfloat16 checkpoints, the dtypes checked against transformers here; export with --dtype float32 "
            f"(nothing was written)"
        )
    return dtype


def check_expert_dtype(tensor: torch.Tensor, dtype: torch.dtype, key: str, path: str) -> None:
    """Without ``--dtype``, every rank file's experts must have rank 0's dtype (checked as each file is read)."""
    if tensor.dtype != dtype:
        raise CheckpointSetError(
            f"{path}: {key} is {name_of(tensor.dtype)}, rank 0's weights {name_of(dtype)}: config.json's "
            f"torch_dtype names one dtype; export with --dtype float32, float16 or bfloat16 (nothing was written)"
        )


def import_dtypes(dtypes: Dict[str, torch.dtype], hf_dir: str, cast: Optional[torch.dtype]) -> str:
    """What ``import-hf`` tells of precision, after refusing non-floating weights (``dtypes``: name -> dtype)."""
    for name, dtype in dtypes.items():
        if not dtype.is_floating_point:
            raise CheckpointSetError(
                f"{hf_dir} holds {name} as {name_of(dtype)}: a quantized checkpoint; import-hf reads float32, float16 "
                f"or bfloat16 weights: save the model unquantized (nothing was written)"
            )
    held = " and ".join(sorted({name_of(d) for d in dtypes.values()}))
    if cast is None:
        return f"tensors {held}, as the Hugging Face files hold them (--dtype float32, float16 or bfloat16 casts)"
    return f"tensors cast from {held} to {name_of(cast)} (--dtype)"
