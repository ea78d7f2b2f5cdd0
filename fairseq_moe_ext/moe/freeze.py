"""Freezing parts of an MoE model for fine-tuning: ``router``, ``experts``, ``shared`` (any subset but all).

* ``router``: the parameters of every MoE layer's router (``...router.wg.weight``; the cosine router's
  projector, similarity matrix and temperature). The loss-free balance bias (a buffer the optimizer never
  sees) is held too: a frozen router keeps the routing it learned, so the bias that shifts it stops moving.
* ``experts``: the routed experts (the parameters marked ``expert``, held E/P per worker).
* ``shared``: every other parameter: embeddings, attention, layer norms, the dense feed-forward blocks,
  the output projection, and the shared experts (DeepSeek-MoE's always-active ones, which are replicated
  and averaged like any shared parameter).

A frozen parameter gets ``requires_grad = False`` before the optimizer and the data-parallel wrapper are
built, so it has no gradient and no optimizer state, and no backend reduces it (fairseq's legacy_ddp and
torch's DDP skip such parameters, FSDP2 reduce-scatters only gradients that exist, and the experts' replica
all-reduce takes trainable experts only). Torch only; the fairseq flag is ``--moe-freeze``.
"""

from typing import Dict, FrozenSet, Iterable, Optional

import torch.nn as nn

from ..common.refusal import MoEOptionError
from .balance_bias import balance_biases
from .experts import is_expert
from .router import TopKRouter

FREEZABLE_PARTS = ("router", "experts", "shared")


def parse_frozen_parts(value: Optional[str], flag: str = "freeze") -> FrozenSet[str]:
    """``"router,experts"`` -> ``{"router", "experts"}``; ``None`` or ``""``: nothing frozen. An unknown part,
    or all three (nothing would train), is refused in one line naming ``flag``."""
    if value is None:
        return frozenset()
    names = [part.strip() for part in str(value).split(",") if part.strip()]
    unknown = [name for name in names if name not in FREEZABLE_PARTS]
    if unknown:
        raise MoEOptionError(
            f"{flag} {value}: unknown part {unknown[0]!r}: name any of {', '.join(FREEZABLE_PARTS)}, separated by "
            f"commas (e.g. {flag} router)"
        )
    parts = frozenset(names)
    if parts == frozenset(FREEZABLE_PARTS):
        raise MoEOptionError(
            f"{flag} {value} freezes every parameter, so nothing would train: leave at least one of "
            f"{', '.join(FREEZABLE_PARTS)} out"
        )
    return parts


def router_parameter_ids(model: nn.Module) -> set:
    """The ids of every MoE router's parameters in ``model``."""
    return {id(p) for module in model.modules() if isinstance(module, TopKRouter) for p in module.parameters()}


def part_of(param, router_ids: set) -> str:
    if id(param) in router_ids:
        return "router"
    return "experts" if is_expert(param) else "shared"


def freeze_parts(model: nn.Module, parts: Iterable[str]) -> Dict[str, int]:
    """Set ``requires_grad = False`` on the parameters of ``parts`` (checked names) and hold the balance
    biases with a frozen router; returns the number of elements frozen per part (every part named, even
    one with no parameter)."""
    parts = frozenset(parts)
    frozen = {part: 0 for part in FREEZABLE_PARTS if part in parts}
    if not parts:
        return frozen
    router_ids = router_parameter_ids(model)
    for param in model.parameters():
        part = part_of(param, router_ids)
        if part in parts:
            param.requires_grad_(False)
            frozen[part] += param.numel()
    if "router" in parts:
        for bias in balance_biases(model):
            bias.frozen = True
    return frozen
