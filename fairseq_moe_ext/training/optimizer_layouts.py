"""A set resumed under another backend in the same precision keeps its optimizer state: fairseq's two
mixed-precision wrappers save the same state in two layouts, converted here where the math allows.

Under ``--fp16`` / ``--bf16``, ``--ddp-backend fully_sharded`` steps the fp32 shards in place with
fairseq's ``MemoryEfficientFP16Optimizer`` (``fairseq_integration/precision.py``, hook 12), while
``legacy_ddp``, ``no_c10d``, ``c10d`` and ``pytorch_ddp`` build ``FP16Optimizer``, which steps fp32 copies.
Both save the wrapped optimizer's own state dict (per parameter, fp32, by position in the trained
parameters) and the fp16 loss scale; the one difference is that ``FP16Optimizer`` may flatten every
parameter into one fp32 vector (plain ``--fp16`` without experts on several workers), where the wrapped
optimizer's state is that vector's. fairseq refuses a resume whose wrapper's class name differs
(``Trainer.load_checkpoint``'s assertion, "Optimizer does not match"), so:

* the two wrappers are one family: the saved name is taken for the one this run built, and
  ``to_layout`` cuts a flat state into per-parameter pieces or joins pieces into one vector, which is
  exact for an optimizer whose state is element-wise (each element's moments are its own; a 0-dim entry
  such as Adam's step is one value for all). A state that is not element-wise (Adafactor's factored
  moments, a step count that differs between parameters) is left as it is and torch refuses it.
* any other change of the optimizer's class (a precision change: fp32 or ``--amp`` against ``--fp16`` /
  ``--bf16``) is refused in one line naming ``--reset-optimizer`` and what it starts afresh.

The fp32 weights themselves are the set's (``fully_sharded`` saves its fp32 shards); ``FP16Optimizer``
makes its fp32 copies from the low-precision model it loads, as it does when resuming its own sets.
Torch only: plain dicts in, plain dicts out.
"""

import math
from typing import List, Optional, Sequence, Tuple

import torch

from ..common.refusal import MoEOptionError

Shape = Tuple[int, ...]
MIXED_PRECISION_WRAPPERS = ("FP16Optimizer", "MemoryEfficientFP16Optimizer")
# What --reset-optimizer starts afresh (fairseq's Trainer.load_checkpoint skips all of it).
RESET_LOSES = "the optimizer's moments, the learning-rate schedule and the update count"


def carries_over(saved_name: str, built_name: str) -> bool:
    """Can a state saved by ``saved_name`` be loaded by ``built_name`` (both fairseq optimizer classes)?"""
    return saved_name == built_name or {saved_name, built_name} <= set(MIXED_PRECISION_WRAPPERS)


def optimizer_mismatch(path: str, saved_name: str, built_name: str) -> MoEOptionError:
    return MoEOptionError(
        f"{path} holds the state of {saved_name} and this run builds {built_name} (another precision flag "
        f"than the set's): resume with the set's precision flag, or add --reset-optimizer to start "
        f"{RESET_LOSES} afresh"
    )


def _state_layout(optim_state: dict) -> Optional[List[int]]:
    """The saved parameters' ids of a one-group state dict, or None for any other layout."""
    groups = optim_state.get("param_groups") if isinstance(optim_state, dict) else None
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0].get("params"), list):
        return None
    return list(groups[0]["params"])


def _split_flat(entry: dict, shapes: Sequence[Shape]) -> Optional[List[dict]]:
    numels = [math.prod(shape) for shape in shapes]
    pieces = [{} for _ in shapes]
    for key, value in entry.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if value.numel() != sum(numels):
                return None
            for piece, chunk, shape in zip(pieces, value.reshape(-1).split(numels), shapes):
                piece[key] = chunk.clone().view(shape)
        else:  # a 0-dim entry (Adam's step) or a plain value: the same for every element
            for piece in pieces:
                piece[key] = value.clone() if torch.is_tensor(value) else value
    return pieces


def _join(entries: List[dict], numels: Sequence[int]) -> Optional[dict]:
    keys = set(entries[0])
    if any(set(e) != keys for e in entries):
        return None
    joined = {}
    for key in keys:
        values = [e[key] for e in entries]
        if all(torch.is_tensor(v) and v.dim() > 0 for v in values):
            if [v.numel() for v in values] != list(numels):
                return None
            joined[key] = torch.cat([v.reshape(-1) for v in values])
        elif all(torch.equal(torch.as_tensor(v), torch.as_tensor(values[0])) for v in values):
            joined[key] = values[0].clone() if torch.is_tensor(values[0]) else values[0]
        else:  # a step count that differs between parameters has no single value
            return None
    return joined


def to_layout(optim_state: dict, shapes: Sequence[Shape]) -> dict:
    """``optim_state`` (a torch optimizer's state dict) for an optimizer over parameters of ``shapes``
    (one 1-dim shape: FP16Optimizer's flat vector): cut or joined where the layouts differ and the state
    is element-wise, else returned as it is."""
    shapes = [tuple(shape) for shape in shapes]
    numels = [math.prod(shape) for shape in shapes]
    ids = _state_layout(optim_state)
    if ids is None or len(ids) == len(numels) or not numels:
        return optim_state
    state = optim_state.get("state", {})
    group = optim_state["param_groups"][0]
    if len(ids) == 1 and len(numels) > 1:  # flat -> per parameter
        if ids[0] not in state:
            new_state = {}
        else:
            pieces = _split_flat(state[ids[0]], shapes)
            if pieces is None:
                return optim_state
            new_state = dict(enumerate(pieces))
        return dict(optim_state, state=new_state, param_groups=[dict(group, params=list(range(len(numels))))])
    if len(shapes) == 1 and len(shapes[0]) == 1 and len(ids) > 1:  # per parameter -> flat
        if not any(i in state for i in ids):
            new_state = {}
        elif not all(i in state for i in ids):
            return optim_state  # some parameters never stepped: no whole vector to make
        else:
            entries = [state[i] for i in ids]
            sizes = [next((v.numel() for v in e.values() if torch.is_tensor(v) and v.dim() > 0), 0) for e in entries]
            if sum(sizes) != numels[0]:
                return optim_state
            joined = _join(entries, sizes)
            if joined is None:
                return optim_state
            new_state = {0: joined}
        return dict(optim_state, state=new_state, param_groups=[dict(group, params=[0])])
    return optim_state
