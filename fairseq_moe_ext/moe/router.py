"""Routers: score every token against every expert and pick its top-k experts.

What a router type computes (its parameters, logits, scores, probabilities, and whether its gates are
renormalised over the chosen experts) is its scorer in ``scorers.py``; ``TopKRouter`` does the rest the
same for every type.

Given a balance bias (``forward``'s ``selection_bias``, the owning layer's: balance_bias.py) the experts are
chosen by ``score + bias`` while the gates stay functions of the scores alone.

The router runs in fp32 when ``fp32=True`` whatever the activation dtype: autocast is switched off
inside, because softmax over a handful of bf16 logits decides which expert a token sees and small
rounding differences flip that decision between otherwise identical runs.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from .layer_config import ROUTER_TYPES, RoutingConfig
from .scorers import SCORERS
from .second_expert import randomly_kept_second, sampled_second_expert

__all__ = ["ROUTER_TYPES", "Routing", "TopKRouter", "take_chosen"]


# fmt: off
@dataclass
class Routing:
    """What the router decided for N tokens (all tensors are on the tokens' device)."""

    logits: torch.Tensor  # [N, E] fp32 (or activation dtype when fp32=False)
    probs: torch.Tensor  # [N, E] softmax(logits)
    expert_index: torch.Tensor  # [N, k] chosen experts, best first
    gates: torch.Tensor  # [N, k] weight of each chosen expert in the combined output
    priority_score: Optional[torch.Tensor]  # [N] lower is served first; None = batch order
# fmt: on


class _TakeChosen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs, expert_index):
        ctx.save_for_backward(expert_index)
        ctx.num_experts = probs.shape[1]
        return probs.gather(1, expert_index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (expert_index,) = ctx.saved_tensors
        shape = (grad.shape[0], ctx.num_experts)
        return grad.new_zeros(shape).scatter_(1, expert_index, grad), None


def take_chosen(probs: torch.Tensor, expert_index: torch.Tensor) -> torch.Tensor:
    """``probs.gather(1, expert_index)`` for a token's distinct choices: the backward writes each
    gradient to its own place instead of autograd's ``scatter_add`` (atomic adds on CUDA)."""
    return _TakeChosen.apply(probs, expert_index)


class TopKRouter(nn.Module):
    """Routes with the options of ``routing`` (checked when it was built). ``balance_bias``: the owning
    layer's ``BalanceBias`` module (``MoELayer`` makes it from ``routing.balance_bias_rate``), held here only
    so that its state key stays ``router.balance_bias.bias``: the router never reads it; the layer passes
    its values to ``forward``."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        routing: RoutingConfig = RoutingConfig(),
        balance_bias: Optional[nn.Module] = None,
        cosine_proj_dim: int = 256,
        cosine_init_temperature: float = 0.5,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.k = routing.k
        self.router_type = routing.router_type
        self.fp32 = routing.fp32
        self.gate_noise = routing.gate_noise
        # Renormalised here (before capacity) unless the layer renormalises over the slots it kept.
        self.normalize_gates = routing.normalize_gates and not routing.normalize_gates_after_dropping
        self.batch_prioritized = routing.batch_prioritized
        self.balance_bias = balance_bias  # the layer's, here for its state key only (never read here)
        # The nllb branch's --moe-second-expert-policy (second_expert.py); "all" is plain top-2.
        self.second_expert_policy = routing.second_expert_policy
        self.scorer = SCORERS[self.router_type]  # a plain object: its parameters are the router's own
        self.scorer.add_parameters(self, model_dim, num_experts, cosine_proj_dim, cosine_init_temperature)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.scorer.logits(self, x)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-expert affinities (the scorer's: softmax over experts, or an independent sigmoid each)."""
        return self.scorer.scores(self, logits)

    def forward(self, x: torch.Tensor, selection_bias: Optional[torch.Tensor] = None) -> Routing:
        """Route ``x`` of shape ``[N, model_dim]``; ``selection_bias`` (``[E]``, the layer's balance bias) is
        added to the scores that choose the experts (never to the gates)."""
        if x.dim() != 2:
            raise ValueError(f"router expects [tokens, model_dim], got shape {tuple(x.shape)}")
        device_type = x.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            if self.fp32:
                x = x.float()
            logits = self.compute_logits(x)
            scores = self.scores(logits)
            probs = self.scorer.probs(scores)
            selection_scores = logits
            if self.training and self.gate_noise > 0:
                # Noise explores alternatives during training; it changes which experts are chosen
                # but not the gate values, so the output stays a smooth function of the logits.
                noise = torch.randn_like(logits) * (self.gate_noise / self.num_experts)
                selection_scores = logits.detach() + noise
            if selection_bias is not None:
                # The bias shifts scores (not logits), for choosing only.
                selection_scores = self.scores(selection_scores.detach()) + selection_bias
            expert_index = torch.topk(selection_scores, self.k, dim=-1, sorted=True).indices
            if self.second_expert_policy == "sampling":
                second = sampled_second_expert(logits, expert_index[:, 0])
                expert_index = torch.stack([expert_index[:, 0], second], dim=1)
            gates = take_chosen(scores, expert_index)
            if self.normalize_gates or self.scorer.gates_normalised_over_chosen:
                total = gates.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(gates.dtype).eps)
                if self.k == 1:
                    # One normalised gate is exactly 1 (so an upcycled layer is exactly its dense FFN),
                    # and p / p would give the router no gradient at all: divide by p's value only, so
                    # the router learns from d log p, the unnormalised (Switch) gate's gradient over p.
                    total = total.detach()
                gates = gates / total
            if self.second_expert_policy == "random":
                # After the gates: the draw compares with the second gate as it stands (normalised or not).
                expert_index = randomly_kept_second(expert_index, gates, self.num_experts)
        # Batch-prioritised routing (Riquelme et al.): when an expert is over capacity, the tokens
        # the router is most confident about are served first: by their top-1 probability before any
        # renormalisation over the chosen k, as the nllb branch and Hugging Face's NllbMoe rank them.
        priority_score = -probs.gather(1, expert_index[:, :1]).squeeze(1).detach() if self.batch_prioritized else None
        return Routing(logits, probs, expert_index, gates, priority_score)
