"""Load balancing without an auxiliary loss (DeepSeek-V3; Wang et al. 2024, "Auxiliary-Loss-Free
Load Balancing Strategy for Mixture-of-Experts").

Each MoE layer keeps a per-expert bias ``b`` that is added to the routing scores used to *choose*
experts (never to the gate values that weight their outputs). After every optimizer step it moves by
a fixed rate ``u`` towards balance: ``b_i += u * sign(mean_load - load_i)``, where ``load_i`` is how
many token-slots chose expert ``i`` during the update (all micro-batches of ``--update-freq``, every
worker of the statistics group: each forward counts every worker's load, which the layer's exchange of
counts brings anyway, so the bias is identical on every worker, like a shared parameter, and moves with
no collective of its own).

The bias is a persistent fp32 buffer (saved in checkpoints, kept fp32 under ``.half()``); the load
being accumulated is a plain tensor attribute, not a buffer, so that DDP's buffer broadcast never
overwrites one worker's count with another's. Validation and inference (``eval()``) neither count
load nor change the bias. Nothing here reads a tensor on the host.
"""

import math
from typing import Optional

import torch
import torch.nn as nn

from ..common.refusal import MoEOptionError

# The rate DeepSeek-V3 used for most of its training.
DEFAULT_BIAS_UPDATE_RATE = 0.001
# How checkpoint tools find the bias among a model's keys.
BIAS_KEY_SUFFIX = ".balance_bias.bias"


def check_bias_update_rate(rate) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise MoEOptionError(
            f"the bias update rate must be a finite number > 0, got {rate!r}: use e.g. {DEFAULT_BIAS_UPDATE_RATE} "
            f"(DeepSeek-V3's)"
        )
    return float(rate)


class BalanceBias(nn.Module):
    def __init__(self, num_experts: int, update_rate: float = DEFAULT_BIAS_UPDATE_RATE):
        super().__init__()
        self.num_experts = num_experts
        self.update_rate = float(update_rate)  # checked where it was configured (RoutingConfig)
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))
        self.pending_load: Optional[torch.Tensor] = None  # [E] int64, every worker's, since the last update
        self.frozen = False  # held where the router is frozen (freeze.py): the load is counted, then dropped

    def observe(self, load: torch.Tensor) -> None:
        """Count one training forward's load: ``[E]`` token-slots per expert (the layer's count of every
        worker's real tokens' choices, pad tokens left out)."""
        if not self.training:
            return
        self.pending_load = load if self.pending_load is None else self.pending_load + load

    @torch.no_grad()
    def update(self) -> None:
        """One step towards balance from the load counted since the last update (every worker's: the same
        on every worker, so every worker takes the same step)."""
        load = self.pending_load
        self.pending_load = None
        if self.frozen:  # the same on every worker (one flag for all)
            return
        if load is None:  # no training forward since the last update: nothing chosen here
            load = torch.zeros(self.num_experts, dtype=torch.long, device=self.bias.device)
        total = load.to(torch.float64)
        self.bias.add_(torch.sign(total.mean() - total).to(self.bias.dtype), alpha=self.update_rate)

    def discard(self) -> None:
        """Forget the load counted since the last update (the optimizer step was skipped)."""
        self.pending_load = None

    def _apply(self, fn, *args, **kwargs):
        # Keep the bias fp32 when the model is cast to fp16/bf16: steps of 0.001 vanish in fp16 near 1.
        kept = self.bias
        super()._apply(fn, *args, **kwargs)
        if self.bias.dtype != kept.dtype:
            self.bias = kept.to(self.bias.device)
        return self

    def extra_repr(self):
        return f"experts={self.num_experts}, update_rate={self.update_rate}"


def balance_biases(model: nn.Module):
    """Every ``BalanceBias`` of ``model``'s MoE layers, in module order."""
    found = []
    for module in model.modules():
        # The layer's own handle (its router holds the module only for its state key, and has no router).
        bias = getattr(module, "balance_bias", None) if hasattr(module, "router") else None
        if isinstance(bias, BalanceBias):
            found.append(bias)
    return found


def update_balance_biases(model: nn.Module, stepped: bool = True) -> None:
    """After an optimizer step (``stepped``), move every layer's bias; after a skipped one, drop
    the load counted for it."""
    for bias in balance_biases(model):
        if stepped:
            bias.update()
        else:
            bias.discard()
