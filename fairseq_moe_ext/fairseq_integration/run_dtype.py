"""The dtype an inference entry point runs an MoE model in (the cast of hooks 8 and 11).

fairseq 0.12.3's inference CLIs cast a loaded model only for ``--fp16`` (``if cfg.common.fp16:
model.half()`` in generate, interactive, validate and eval-lm), after the model was built and loaded in
fp32, and never for ``--bf16``: ``fairseq-generate --bf16`` silently runs fp32, twice the memory asked
for. The hub interface (``from_pretrained(..., bf16=True)``) casts for neither. Here the dtype asked for
is recorded when an inference CLI's command line is parsed (hook 11), or read from the hub's keyword
overrides, and the load hook (8) casts every MoE model it returns to it, on the CPU, before the CLI moves
it to a GPU; the CLI's own ``model.half()`` then changes nothing. As in training (fairseq's Trainer casts
the model the same way), the router computes in fp32 unless --moe-gating-no-fp32, and the balance bias
stays an fp32 buffer (moe/balance_bias.py). One INFO line names the dtype the model runs in.
"""

import contextlib
import logging
from typing import Mapping, Optional

import torch

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..moe import MoELayer
from ..parallel.process_state import STATE, ModelLoad

logger = logging.getLogger(__name__)

# fairseq's flags, in the order its Trainer honours them (--fp16 first); memory-efficient ones set the
# plain flag when fairseq parses them, but a hub override is taken as written.
FLAGS = (
    ("fp16", torch.float16),
    ("memory_efficient_fp16", torch.float16),
    ("bf16", torch.bfloat16),
    ("memory_efficient_bf16", torch.bfloat16),
)
NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def asked_dtype(source) -> Optional[torch.dtype]:
    """The dtype ``source`` (parsed args, a cfg, or the hub's overrides) asks for: None when it names no flag
    at all (a mapping without any of them), else float16, bfloat16 or float32."""
    if isinstance(source, Mapping):
        named = [(flag, dtype) for flag, dtype in FLAGS if flag in source]
        if not named:
            return None
        return next((dtype for flag, dtype in named if source[flag]), torch.float32)
    return next((dtype for flag, dtype in FLAGS if config_value(source, flag, False)), torch.float32)


def dtype_for_load(arg_overrides, asked: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The hub's keyword overrides when they name a precision flag, else what the CLI ``asked`` for (None: no
    inference CLI and no flag, a load outside generation that keeps fairseq's dtype)."""
    from_overrides = asked_dtype(arg_overrides) if isinstance(arg_overrides, Mapping) else None
    return from_overrides if from_overrides is not None else asked


@contextlib.contextmanager
def built_for_load(dtype: Optional[torch.dtype], every_expert_local: bool):
    """Around fairseq's load of a model to run in ``dtype`` (None: as built, fp32): MoE layers build their
    experts on ``meta`` in that dtype (the checkpoint's tensors become them, moe/experts.py), and fp16/bf16 runs
    build every other parameter in it directly, so no fp32 copy of the model exists on the way. The models
    built inside hold every expert unless ``every_expert_local`` is False (an expert-sharded run). Yields the
    ``ModelLoad`` the build and the checkpoint reads inside see as ``STATE.model_load``."""
    previous = (STATE.model_load, torch.get_default_dtype())
    STATE.model_load = ModelLoad(experts_dtype=dtype or torch.float32, every_expert_local=every_expert_local)
    if dtype in (torch.float16, torch.bfloat16):
        torch.set_default_dtype(dtype)
    try:
        yield STATE.model_load
    finally:
        STATE.model_load = previous[0]
        torch.set_default_dtype(previous[1])


def check_loaded(models, filenames) -> None:
    """Experts built on meta that the checkpoint did not fill (a non-strict load of a file without them)."""
    for model, name in zip(models, filenames):
        empty = [key for key, p in model.named_parameters() if p.is_meta]
        if empty:
            raise MoEOptionError(
                f"{name} holds no {empty[0]} ({len(empty)} expert tensor(s) missing): the file is not a checkpoint of "
                f"this MoE model; pass the checkpoint it was saved as, or load it with strict=True to see what differs"
            )


def cast_for_inference(models, dtype: Optional[torch.dtype]) -> None:
    """Cast each MoE model of ``models`` to ``dtype`` in place (on the device it is on) and say so."""
    if dtype is None:
        return
    for model in models:
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        if not layers:
            if dtype != torch.float32:
                model.to(
                    dtype=dtype
                )  # built in that dtype (built_for_load): its fp32 buffers follow, as --fp16's half()
            continue
        model.to(dtype=dtype)
        logger.info(describe(model, layers, dtype))


def describe(model, layers, dtype: torch.dtype) -> str:
    name = NAMES.get(dtype, str(dtype))
    routing = "float32" if all(layer.router.fp32 for layer in layers) else f"{name} (--moe-gating-no-fp32)"
    biases = [layer.balance_bias for layer in layers if layer.balance_bias is not None]
    bias = f", balance bias {NAMES.get(biases[0].bias.dtype)}" if biases else ""
    held = {p.dtype for p in model.parameters()}
    weights = ", ".join(sorted(NAMES.get(d, str(d)) for d in held))
    return f"the model runs in {name}: weights {weights}, routing computed in {routing}{bias}"
