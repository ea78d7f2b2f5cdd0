"""How many token-slots each expert may take, with Tutel's ``capacity_factor`` semantics, and
which slots are dropped when an expert is over capacity.

``N`` tokens (pad tokens excluded), ``E`` experts, top-``k`` routing, ``spe = ceil(N / E)``:

* ``cf > 0``  fixed capacity ``k * int(cf * spe)``; slots beyond it are dropped (the token's MoE
  output for that choice is zero and the residual connection carries it);
* ``cf == 0`` dropless: every slot is served;
* ``cf < 0``  dropless up to a bound: at most ``k * int(|cf| * spe)`` slots per expert.

``int(|cf| * spe)`` is capped at ``MAX_SLOTS`` (2**40, more token-slots than any batch holds, so
the same slots are kept), which keeps the capacity within int64 whatever finite factor is given:
``1e39 * spe`` cast to int64 wraps to a negative or zero capacity, which would drop every slot.

Tutel computes the dropless capacity as the maximum load over ranks because it pads every expert
to one size. We never pad, so ``cf == 0`` needs no number at all and ``cf < 0`` is simply the bound:
a slot is dropped exactly when its position in the expert's queue reaches ``k * int(|cf| * spe)``.

``N`` is the token count of the whole expert-parallel group and the queue order is global, so the
same batch is routed and dropped the same way whether one worker or many process it.
"""

import math
from typing import List, Optional, Union

import torch

from ..common.refusal import MoEOptionError
from . import comm
from .dispatch import bucket_counts

MAX_SLOTS = 2**40  # per expert and choice: beyond any batch's token count, far within int64 (times k)


def check_capacity_factor(capacity_factor, name: str = "capacity_factor") -> float:
    try:
        value = float(capacity_factor)
    except (TypeError, ValueError):
        raise MoEOptionError(f"{name} must be a number, got {capacity_factor!r}") from None
    if not math.isfinite(value):
        raise MoEOptionError(
            f"{name} must be finite, got {capacity_factor!r}: use 0 for dropless routing, "
            f"a positive value for a fixed capacity, or a negative one for a bounded dropless one"
        )
    return value


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> Optional[int]:
    """Slots per expert, or ``None`` when every slot is served (``capacity_factor == 0``); the factor
    was checked where it was configured (``MoELayerConfig``)."""
    if capacity_factor == 0:
        return None
    tokens_per_expert = (num_tokens + num_experts - 1) // num_experts
    return k * min(int(abs(capacity_factor) * tokens_per_expert), MAX_SLOTS)


def expert_capacity_tensor(
    num_tokens: torch.Tensor, num_experts: int, k: int, capacity_factor: float
) -> Optional[torch.Tensor]:
    """``expert_capacity`` for a token count that lives on the device, computed there (no host read):
    the same integer as ``expert_capacity(int(num_tokens), ...)``, fp64 products included."""
    if capacity_factor == 0:
        return None
    tokens_per_expert = torch.div(num_tokens.long() + (num_experts - 1), num_experts, rounding_mode="floor")
    slots = torch.floor(abs(capacity_factor) * tokens_per_expert.double()).clamp(max=float(MAX_SLOTS))
    return k * slots.long()


def token_fraction_capacity(num_positions: torch.Tensor, fraction: float) -> torch.Tensor:
    """The fairseq nllb branch's (and Hugging Face NllbMoe's) evaluation capacity, ``ceil(fraction * S)`` slots
    per expert for both choices together, S being every token position of the batch, pads included (they
    route B x T tensors and count pads). Computed in fp64 on the device, as ``math.ceil`` on the host; capped
    at MAX_SLOTS so that a huge fraction serves every slot instead of wrapping int64."""
    return torch.ceil(float(fraction) * num_positions.double()).clamp(max=float(MAX_SLOTS)).long()


def slots_within_capacity(
    expert_index: torch.Tensor,
    num_experts: int,
    capacity: Union[int, torch.Tensor],
    priority_score: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Which of the ``[N, k]`` routed slots fit in their expert's capacity.

    Queue order (GShard): every token's first choice before any second choice; within one choice,
    tokens in batch order, or by ascending ``priority_score`` when given (batch-prioritised routing
    passes minus the top-1 gate). Ties keep batch order, so the result is a pure function of the
    concatenated batch. ``expert_index`` may hold the id ``num_experts`` for slots that are not
    routed at all (pad tokens): they queue on their own and never take an expert's place.
    """
    n, k = expert_index.shape
    if priority_score is None:
        token_order = torch.arange(n, device=expert_index.device)
    else:
        token_order = torch.argsort(priority_score, stable=True)
    queue_experts = expert_index.index_select(0, token_order).t().reshape(-1)  # [k*N] in service order
    by_expert = torch.argsort(queue_experts, stable=True)
    load = bucket_counts(queue_experts, num_experts + 1)
    first_position = torch.cumsum(load, 0) - load
    position = torch.empty_like(by_expert)
    position[by_expert] = torch.arange(k * n, device=expert_index.device) - first_position[queue_experts[by_expert]]
    keep = torch.empty_like(expert_index, dtype=torch.bool)
    keep[token_order] = (position < capacity).view(k, n).t()
    return keep


def slots_within_capacity_of_batch(
    expert_index: torch.Tensor, num_experts: int, capacity, score: Optional[torch.Tensor], group, sizes: List[int]
):
    """``slots_within_capacity`` of this worker's rows, decided over the whole batch of ``group`` (None: this
    process alone), queued by ``score``: decide on the gathered routing decisions (each worker's ``sizes[r]`` rows,
    gathered in one all-gather with their scores) exactly as a single process would, then keep this worker's
    rows. Returns ``(keep [N, k], kept [W, E])`` as ``slots_within_capacity_of_counts`` does."""
    if group is None:
        keep = slots_within_capacity(expert_index, num_experts, capacity, score)
        served = torch.where(keep, expert_index, num_experts)
        return keep, bucket_counts(served.reshape(-1), num_experts + 1)[:num_experts].unsqueeze(0)
    k = expert_index.shape[1]
    both = torch.cat([expert_index.double(), score.double().unsqueeze(1)], 1)  # ids and fp32 scores exact in fp64
    gathered = comm.all_gather_rows(both, sizes, group)
    all_index, all_score = gathered[:, :k].long(), gathered[:, k].to(score.dtype)
    keep = slots_within_capacity(all_index, num_experts, capacity, all_score)
    served = torch.where(keep, all_index, num_experts)
    starts = [sum(sizes[:r]) for r in range(len(sizes) + 1)]
    kept = [bucket_counts(served[a:b].reshape(-1), num_experts + 1)[:num_experts] for a, b in zip(starts, starts[1:])]
    start = starts[comm.group_rank(group)]
    return keep[start : start + expert_index.shape[0]], torch.stack(kept)


def _queue_positions(expert_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[N, k]``: each slot's place among this worker's slots of the same choice and expert, in token order."""
    n, k = expert_index.shape
    key = (expert_index + torch.arange(k, device=expert_index.device) * (num_experts + 1)).t().reshape(-1)
    by_key = torch.argsort(key, stable=True)
    load = bucket_counts(key, k * (num_experts + 1))
    first = torch.cumsum(load, 0) - load
    position = torch.empty_like(by_key)
    position[by_key] = torch.arange(k * n, device=key.device) - first[key[by_key]]
    return position.view(k, n).t()


def slots_within_capacity_of_counts(
    expert_index: torch.Tensor, num_experts: int, capacity: torch.Tensor, counts: torch.Tensor, rank: int
):
    """``slots_within_capacity`` in batch order (no priority score) of this worker's rows within the batch of
    every worker, from each worker's slots per choice and expert alone, ``counts`` ``[W, k, E]`` (the layer's
    exchange, ``batch_totals.choice_counts``; this worker is row ``rank``): slot ``(t, j)`` of expert ``e`` stands
    after every slot of an earlier choice of ``e`` and every earlier worker's choice-``j`` slots of ``e``, so no
    routing decision needs to travel. Returns ``(keep [N, k], kept [W, E])``: which of this worker's slots are
    served, and how many slots each worker has served per expert (the all-to-all's split sizes, everyone's)."""
    before_choice = torch.cumsum(counts.sum(0), 0) - counts.sum(0)  # [k, E]
    before_rank = torch.cumsum(counts, 0) - counts  # [W, k, E]
    start = before_choice.unsqueeze(0) + before_rank  # where each worker's slots of (j, e) begin in e's queue
    kept = torch.minimum((capacity - start).clamp_min(0), counts).sum(1)  # [W, E]
    mine = torch.cat([start[rank], start.new_zeros(start.shape[1], 1)], 1)  # unrouted slots (id E) start at 0
    place = mine.gather(1, expert_index.t()).t() + _queue_positions(expert_index, num_experts)
    return place < capacity, kept
