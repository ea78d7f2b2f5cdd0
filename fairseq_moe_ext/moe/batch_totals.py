"""What the router losses and the capacity read about a batch, totalled over the statistics group.

One all-reduce per layer forward (each collective is a point where the faster worker waits) carries every
count and sum: the first choices per expert, the real tokens, the router probabilities summed per expert,
the squared log-sum-exps, and for the nllb branch's evaluation capacity every token position. With W
workers they are the counts and sums of the batches laid end to end, so W workers decide as one process.

Counts stay exact integers and sums fp32 (or wider) whatever the router's dtype: with --moe-gating-no-fp32
an fp16 count overflows at 65,504 tokens and bf16 counts 1001 as 1000. fp64 holds the int64 counts exactly
(below 2^53) and every fp32 sum; with one process the round trip fp32 -> fp64 -> fp32 changes no bit.
"""

from dataclasses import dataclass
from typing import Optional

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
    positions: Optional[torch.Tensor]  # int64 scalar: every worker's token positions, pads too (if asked)
    local_tokens: torch.Tensor  # [1] int64: this worker's real tokens
    local_probs: torch.Tensor  # [N, E]: this worker's probabilities, zero at pad tokens
# fmt: on


def batch_totals(routing, expert_index: torch.Tensor, real: Optional[torch.Tensor], group, count_positions: bool):
    """``routing``: the router's decision for ``N`` tokens; ``expert_index`` its choices with pad tokens sent
    to the id ``E``; ``real`` (``[N]`` bool or None) the tokens that count; ``group``: whose batches are
    totalled (None: this process); ``count_positions``: total the token positions too."""
    num_experts = routing.probs.shape[1]
    top1_count = bucket_counts(expert_index[:, 0], num_experts + 1)[:num_experts]
    num_real = top1_count.sum().view(1)
    lse_square = torch.logsumexp(routing.logits.float(), dim=-1).pow(2)
    probs = routing.probs
    if real is not None:
        lse_square = torch.where(real, lse_square, 0.0)
        probs = torch.where(real.unsqueeze(1), probs, 0.0)
    prob_sum = probs.sum(0, dtype=torch.float32)
    parts = [top1_count.double(), num_real.double(), prob_sum.double(), lse_square.sum().double().view(1)]
    if count_positions:  # every token position, pads included: the S of the branch's ceil(f * S)
        parts.append(torch.full((1,), float(expert_index.shape[0]), dtype=torch.float64, device=probs.device))
    # comm.all_reduce_sum's backward sums too: the losses' gradients are those of the whole batch.
    totals = comm.all_reduce_sum(torch.cat(parts), group)
    counts = totals[: num_experts + 1].round().long()
    sums = totals[num_experts + 1 :].float()
    positions = totals[-1].round().long() if count_positions else None
    return BatchTotals(
        counts[:num_experts], counts[-1], sums[:num_experts], sums[num_experts], positions, num_real, probs
    )
