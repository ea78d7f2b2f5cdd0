"""Router types: each one a small scorer, named in ``SCORERS`` (``--moe-router`` chooses by name).

A scorer says what a router type computes from the tokens; ``TopKRouter`` (router.py) does the rest
the same for every type (fp32, noise, the balance bias, top-k, the second-expert policy, priority).
It keeps no state: its parameters are made on the router (``add_parameters``), so their state keys
stay the router's own (``router.wg.weight``, ``router.sim_matrix``, ...) and sets written before load.

  * ``top``: a linear projection ``d_model -> E``, softmax scores (Tutel's semantics);
  * ``cosine``: a projection ``d_model -> proj_dim``, cosine similarity against one learned vector
    per expert, times a learned temperature whose scale is clamped at 100 (``log 100``), softmax;
  * ``sigmoid`` (DeepSeek-V3): linear logits, per-expert scores ``sigmoid(logits)``, gates = the
    chosen k scores normalised to sum to 1 (so k >= 2: one normalised gate is always 1 and the
    router would get no gradient). ``probs`` (behind the balance loss and the entropy statistic) are
    the scores normalised over all experts, as in DeepSeek-V3's sequence-wise balance loss.

A new router type is one ``Scorer`` subclass and one row in ``SCORERS`` (docs/architecture.md).
"""

import math
from abc import ABC, abstractmethod
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["SCORERS", "CosineScorer", "LinearScorer", "Scorer", "SigmoidScorer"]


class Scorer(ABC):
    """One router type. ``router.fp32`` says whether to compute in fp32 (``x`` is then fp32 already)."""

    # What it computes, in a few words: --moe-router's help (options/model.py) names each type with it.
    summary = ""
    # The chosen k scores are renormalised to sum to 1 whatever --moe-normalize-gates says (so k >= 2).
    gates_normalised_over_chosen = False

    @abstractmethod
    def add_parameters(self, router: nn.Module, model_dim: int, num_experts: int, proj_dim: int, temperature: float):
        """Make this type's parameters as attributes of ``router`` (their names are state keys)."""

    @abstractmethod
    def logits(self, router: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``[N, E]`` logits of the tokens ``x [N, d_model]``."""

    def scores(self, router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        """Per-expert affinities (the gates are the chosen ones): softmax over the experts."""
        return torch.softmax(logits, dim=-1, dtype=torch.float32 if router.fp32 else None)

    def probs(self, scores: torch.Tensor) -> torch.Tensor:
        """A distribution over the experts (balance loss, entropy, priority): the softmax scores."""
        return scores


class LinearScorer(Scorer):
    """``top``: linear logits, softmax scores."""

    summary = "linear logits, softmax"

    def add_parameters(self, router, model_dim, num_experts, proj_dim, temperature):
        router.wg = nn.Linear(model_dim, num_experts, bias=False)

    def logits(self, router, x):
        weight = router.wg.weight.float() if router.fp32 else router.wg.weight
        return F.linear(x, weight)


class SigmoidScorer(LinearScorer):
    """``sigmoid``: linear logits, an independent sigmoid per expert; probs normalised over all experts."""

    summary = "DeepSeek-V3: sigmoid scores, gates = the chosen k scores normalised to sum to 1; needs k >= 2"
    gates_normalised_over_chosen = True

    def scores(self, router, logits):
        return torch.sigmoid(logits.float() if router.fp32 else logits)

    def probs(self, scores):
        return scores / scores.sum(dim=-1, keepdim=True)


class CosineScorer(Scorer):
    """``cosine``: scaled cosine similarity of the projected token with one vector per expert, softmax."""

    summary = "Tutel's cosine_top: projected cosine similarity times a learned temperature clamped at 100"

    def add_parameters(self, router, model_dim, num_experts, proj_dim, temperature):
        router.cosine_projector = nn.Linear(model_dim, proj_dim)
        router.sim_matrix = nn.Parameter(torch.empty(proj_dim, num_experts))
        nn.init.normal_(router.sim_matrix, std=0.01)
        router.temperature = nn.Parameter(torch.full([1], math.log(1.0 / temperature)))

    def logits(self, router, x):
        proj = router.cosine_projector
        if router.fp32:
            h = F.linear(x, proj.weight.float(), proj.bias.float())
            sim = router.sim_matrix.float()
        else:
            h = proj(x)
            sim = router.sim_matrix
        scale = torch.clamp(router.temperature, max=math.log(100.0)).exp()
        return torch.matmul(F.normalize(h, dim=-1), F.normalize(sim, dim=0)) * scale


# The registry: --moe-router's choices (ROUTER_TYPES, layer_config.py) are its names, in this order.
SCORERS: Dict[str, Scorer] = {"top": LinearScorer(), "cosine": CosineScorer(), "sigmoid": SigmoidScorer()}
