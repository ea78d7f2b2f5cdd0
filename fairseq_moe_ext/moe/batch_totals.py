"""What a layer call needs to know about every worker's batch, from one exchange: each worker's row.

Each worker makes one fp64 row of its counts and sums and the rows are all-gathered over the statistics
group, one collective per layer call (each collective is a point where the faster worker waits). The row:

    [ slots per choice and expert (k x E) | token positions | real tokens | router probabilities summed per
      expert (E) | squared log-sum-exps summed ]

Their sums are what the router losses and the capacity read (the counts and sums of the batches laid end to
end, so W workers decide as one process), and the rows themselves tell every worker what each other worker
sends to each expert: the all-to-all's receive splits, the global load behind the balance bias and, for a
capacity in batch order, where each worker's slots stand in each expert's queue.

Counts stay exact integers and sums fp32 (or wider) whatever the router's dtype: with --moe-gating-no-fp32
an fp16 count overflows at 65,504 tokens and bf16 counts 1001 as 1000. fp64 holds the int64 counts exactly
(below 2^53) and every fp32 sum; with one process the round trip fp32 -> fp64 -> fp32 changes no bit.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch

from . import comm
from .dispatch import bucket_counts


# fmt: off
@dataclass
class BatchTotals:
    first_choices: torch.Tensor  # [E] int64: tokens whose first choice is each expert, every worker's
    tokens: torch.Tensor  # int64 scalar: real tokens, every worker's
    prob_sum: torch.Tensor  # [E] fp32: router probabilities summed over every worker's real tokens
    lse_square_sum: torch.Tensor  # fp32 scalar: sum of logsumexp(logits)^2 over the same tokens
    positions: torch.Tensor  # int64 scalar: every worker's token positions, pads too
    local_tokens: torch.Tensor  # [1] int64: this worker's real tokens
    local_probs: torch.Tensor  # [N, E]: this worker's probabilities, zero at pad tokens
    rows: torch.Tensor  # [W, width] fp64, no gradient: every worker's row (W = 1 in one process)
    host_counts: Optional[List[List[float]]]  # rows[:, :k * E] on the host, where the exchange read them already
# fmt: on


def row_width(num_experts: int, k: int) -> int:
    return k * num_experts + num_experts + 3


def choice_counts(rows: torch.Tensor, num_experts: int, k: int) -> torch.Tensor:
    """``[W, k, E]`` int64: each worker's slots per choice and expert (pads and unrouted slots left out)."""
    return rows[:, : k * num_experts].round().long().view(-1, k, num_experts)


def sent_per_expert(rows: torch.Tensor, num_experts: int, k: int) -> torch.Tensor:
    """``[W, E]`` int64: each worker's slots per expert, every choice (before any capacity)."""
    return choice_counts(rows, num_experts, k).sum(1)


def batch_totals(
    routing, expert_index: torch.Tensor, real, group, sums_in_backward: bool = True, exchange=None
) -> BatchTotals:
    """``routing``: the router's decision for ``N`` tokens; ``expert_index`` its choices with pad tokens sent
    to the id ``E``; ``real`` (``[N]`` bool or None) the tokens that count; ``group``: whose batches are
    totalled (None: this process); ``sums_in_backward``: False where the loss's collector sums each worker's
    weight of the losses itself (``comm.summed_over_ranks``); ``exchange``: ``row -> (rows, host_counts or
    None)`` in place of the all-gather over ``group`` (a lock-step round rides on it, lockstep.py)."""
    num_experts, k = routing.probs.shape[1], expert_index.shape[1]
    per_choice = [bucket_counts(expert_index[:, j], num_experts + 1)[:num_experts] for j in range(k)]
    num_real = per_choice[0].sum().view(1)
    lse_square = torch.logsumexp(routing.logits.float(), dim=-1).pow(2)
    probs = routing.probs
    if real is not None:
        lse_square = torch.where(real, lse_square, 0.0)
        probs = torch.where(real.unsqueeze(1), probs, 0.0)
    prob_sum = probs.sum(0, dtype=torch.float32)
    positions = torch.full((1,), float(expert_index.shape[0]), dtype=torch.float64, device=probs.device)
    row = torch.cat([*(c.double() for c in per_choice), positions, num_real.double(), prob_sum.double()])
    row = torch.cat([row, lse_square.sum().double().view(1)])
    rows, host_counts = (comm.all_gather_row(row, group), None) if exchange is None else exchange(row)
    totals = comm.summed_over_ranks(row, rows, group, sums_in_backward)
    counts = totals[: k * num_experts + 2].round().long()
    sums = totals[k * num_experts + 2 :].float()
    first_choices = counts[:num_experts]
    return BatchTotals(
        first_choices,
        counts[-1],
        sums[:num_experts],
        sums[num_experts],
        counts[-2],
        num_real,
        probs,
        rows.detach(),
        host_counts,
    )
