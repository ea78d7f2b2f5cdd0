"""Collectives an expert-parallel MoE layer needs, each differentiable where the math needs it.

All of them accept ``group=None`` to mean "no expert parallelism" and then do nothing, so the
single-process path runs the very same code.

Every rank must issue these collectives in the same order. MoE layers do so by construction: each
layer issues the same fixed sequence on every forward (also on fairseq's dummy batches, where a
rank has no tokens at all) and autograd replays the mirror sequence in backward.
"""

from typing import List, Tuple

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


class _AllReduceSum(torch.autograd.Function):
    """``y = sum over ranks of x``, identical on every rank.

    Each rank then adds a loss computed from ``y`` to its own objective, so the total objective is
    ``sum_r f(y)`` and ``d/dx_r = sum_r f'(y)``: the backward is a sum over ranks as well. (The
    usual "backward is the identity" would make the result depend on how tokens are split.)
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    if group is None:
        return x
    if not x.requires_grad:
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y
    return _AllReduceSum.apply(x, group)


class _AllToAll(torch.autograd.Function):
    """Rows ``input[sum(send[:r]) : sum(send[:r+1])]`` go to rank ``r``; rows from rank ``r`` land
    at ``output[sum(recv[:r]) : ...]``. The backward sends gradients the reverse way."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits = (send_splits, recv_splits)
        ctx.group = group
        return _all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _all_to_all(grad.contiguous(), recv_splits, send_splits, ctx.group), None, None, None


def _all_to_all(x, send_splits: List[int], recv_splits: List[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, send_splits: List[int], recv_splits: List[int], group=None) -> torch.Tensor:
    if group is None:
        return x
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group)


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """``counts`` is ``[W, L]`` (rows for each destination rank); returns ``[W, L]`` whose row
    ``r`` is what rank ``r`` sent to this rank."""
    if group is None:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def all_gather_rows(x: torch.Tensor, group=None) -> Tuple[torch.Tensor, List[int]]:
    """Concatenate every rank's ``x`` along dim 0 in rank order; ranks may hold different row
    counts, which are returned too. Not differentiable: for routing decisions only."""
    if group is None:
        return x, [x.shape[0]]
    world = dist.get_world_size(group)
    n = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    sizes = [int(s.item()) for s in sizes]
    padded = x.new_zeros((max(sizes),) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[:s] for g, s in zip(gathered, sizes)]), sizes
