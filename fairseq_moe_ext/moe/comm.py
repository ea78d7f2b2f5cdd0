"""Collectives an expert-parallel MoE layer needs, each differentiable where the math needs it.

All of them accept ``group=None`` to mean "no expert parallelism" and then do nothing, so the
single-process path runs the very same code.

Every rank must issue these collectives in the same order. MoE layers do so by construction: each
layer issues the same fixed sequence on every forward (also on fairseq's dummy batches, where a
rank has no tokens at all) and autograd replays the mirror sequence in backward.
"""

from contextlib import contextmanager
from typing import List, Sequence

import torch
import torch.distributed as dist

from ..common.refusal import MoEOptionError, MoERefusal
from .collective_device import (
    MoECollectiveDeviceError,
    check_served,
    collective_device,
    device_mismatch_error,
    is_device_mismatch,
    on_group_device,
)
from .stop_notice import announced_stop


class MoECommunicationError(RuntimeError):
    """A collective of an MoE layer failed: a peer worker died or stalled past the group's timeout."""


class MoEPeerStoppedError(MoERefusal, MoECommunicationError):
    """A peer stopped on purpose and said why (stop_notice.py): its refusal, relayed to this worker."""


@contextmanager
def collective(what: str, group, tensors: Sequence[torch.Tensor] = ()):
    """Run one collective over ``tensors``; a failure is either a device mismatch (a bug here, see
    collective_device.py) or a dead or stalled peer, and says which."""
    check_served(what, tensors, group)
    # Backends report a dead or stalled peer with transport details only ("Connection closed by
    # peer", "Timed out waiting 1800000ms for recv"); say what that means for the job.
    try:
        yield
    except (MoECommunicationError, MoECollectiveDeviceError):
        raise
    except RuntimeError as error:
        if "out of memory" in str(error):  # this worker's own failure, not a peer's: as it is
            raise
        detail = " ".join(str(error).split())[:300]
        if is_device_mismatch(error):
            raise device_mismatch_error(what, tensors, group, detail) from error
        notice = announced_stop()
        if notice is not None:  # a worker stopped on purpose and said why (stop_notice.py)
            raise MoEPeerStoppedError(f"MoE {what} failed because another worker stopped: {notice}") from error
        raise MoECommunicationError(
            f"MoE {what} across {dist.get_world_size(group)} workers failed ({detail}): a peer worker died "
            f"or stalled past the process group's timeout; restart the job with the same command to resume "
            f"from the newest complete checkpoint set (--moe-comm-timeout sets the timeout)"
        ) from error


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
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous().clone(), ctx.group), None


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    with collective("all-reduce of routing statistics", group, [x]):
        dist.all_reduce(x, group=group)
    return x


def all_reduce_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    if group is None:
        return x
    if not x.requires_grad:
        return _all_reduce(x.clone(), group)
    return _AllReduceSum.apply(x, group)


class _SummedOverRanks(torch.autograd.Function):
    """``rows.sum(0)``, the sum over ranks of ``local`` (rows gathered in the forward); its backward sums the
    gradient over ranks as ``_AllReduceSum``'s does, or is the identity where the caller sums instead."""

    @staticmethod
    def forward(ctx, local, rows, group, sums_in_backward):
        ctx.group, ctx.sums_in_backward = group, sums_in_backward
        return rows.sum(0)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.sums_in_backward:
            return grad, None, None, None
        return _all_reduce(grad.contiguous().clone(), ctx.group), None, None, None


def summed_over_ranks(local: torch.Tensor, rows: torch.Tensor, group=None, sums_in_backward: bool = True):
    """The sum over ``group``'s ranks of ``local``, given every rank's ``local`` as ``rows`` (``all_gather_row``):
    the forward needs no collective of its own. Differentiable as ``all_reduce_sum``: each rank adds a loss of the
    sum to its objective, so the gradient is the sum of the ranks' gradients, summed here in backward
    (``sums_in_backward``) or, with False, by the caller, which makes every rank's upstream gradient that sum
    already (the MoE criterions do: each worker's weight of the losses summed once per step, not once per layer)."""
    if group is None:
        return local
    if not local.requires_grad:
        return rows.sum(0)
    return _SummedOverRanks.apply(local, rows, group, sums_in_backward)


class _WeightSummedOverRanks(torch.autograd.Function):
    """``weight * x``; the backward returns every rank's ``upstream * weight`` summed (in fp64), the same on
    every rank: ``x`` is a loss of statistics summed over ranks, so that is the gradient of the ranks'
    objectives together with respect to it."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.weight, ctx.group = weight, group
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.weight.double() if torch.is_tensor(ctx.weight) else float(ctx.weight)
        total = on_group_device((grad.double() * weight).reshape(1), ctx.group)
        return _all_reduce(total, ctx.group).to(grad.device).reshape(grad.shape).to(grad.dtype), None, None


def weight_summed_over_ranks(x: torch.Tensor, weight, group=None) -> torch.Tensor:
    """``weight * x``, where ``x`` is a loss of statistics summed over ``group``'s ranks and every rank weighs it by
    its own ``weight`` (a fairseq worker: its sample size): one all-reduce in backward, in place of one per
    statistic (``summed_over_ranks(..., sums_in_backward=False)``), so with W workers the gradient is that of
    one process weighing the loss by the weights' sum."""
    if group is None or not x.requires_grad:
        return weight * x
    return _WeightSummedOverRanks.apply(x, weight, group)


def all_gather_row(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[W, *x.shape]``: every rank's ``x`` (the same shape on every rank), in rank order; not differentiable."""
    if group is None:
        return x.detach().unsqueeze(0)
    mine = on_group_device(x.detach(), group).contiguous()
    out = mine.new_empty((dist.get_world_size(group),) + tuple(mine.shape))
    with collective("all-gather of routing counts and sums", group, [out, mine]):
        dist.all_gather(list(out.unbind(0)), mine, group=group)
    return out.to(x.device)


def ranks_within(group, statistics_group):
    """Where each member of ``group`` is among ``statistics_group``'s ranks (which include them), in ``group``'s
    order: a ``slice`` where they are consecutive (every layout of this plugin), else a list."""
    if group is statistics_group:
        return slice(0, group_size(group))
    everyone = dist.get_process_group_ranks(statistics_group)
    ranks = [everyone.index(member) for member in dist.get_process_group_ranks(group)]
    consecutive = ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    return slice(ranks[0], ranks[0] + len(ranks)) if consecutive else ranks


def rows_of_group(rows: torch.Tensor, where) -> torch.Tensor:
    """The rows of ``rows`` (one per rank of a statistics group) of the members ``where`` (``ranks_within``) names;
    a list is copied to the device as an index (a host-to-device copy: no layout of this plugin needs one)."""
    if isinstance(where, slice):
        return rows[where]
    return rows.index_select(0, torch.tensor(where, device=rows.device))


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
    with collective("all-to-all of token rows", group, [out, x]):
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, send_splits: List[int], recv_splits: List[int], group=None) -> torch.Tensor:
    if group is None:
        return x
    world = dist.get_world_size(group)
    if len(send_splits) != world or len(recv_splits) != world:
        raise ValueError(
            f"all_to_all got {len(send_splits)} send and {len(recv_splits)} receive splits for a group of "
            f"{world} workers: pass one split per worker of the group the layer was built with"
        )
    if sum(send_splits) != x.shape[0]:
        raise ValueError(
            f"all_to_all send splits sum to {sum(send_splits)} rows but the input has {x.shape[0]}: "
            f"the splits must partition the input's rows"
        )
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group)


def all_gather_rows(x: torch.Tensor, sizes: List[int], group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 in rank order, rank ``r`` holding ``sizes[r]`` rows (known
    from an earlier exchange, so one collective). Not differentiable: for routing decisions only."""
    if group is None:
        return x
    world = dist.get_world_size(group)
    rows = on_group_device(x, group)
    padded = rows.new_zeros((max(sizes),) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = rows
    gathered = [torch.empty_like(padded) for _ in range(world)]
    with collective("all-gather of routing decisions", group, [padded]):
        dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[:s] for g, s in zip(gathered, sizes)]).to(x.device)


def check_same_on_every_rank(values: List[int], names: List[str], what: str, group=None) -> None:
    """Raise on every rank if ``values`` differ between ranks (one collective; for set-up checks)."""
    if group is None:
        return
    mine = torch.tensor(values, dtype=torch.long, device=collective_device(group))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with collective(f"check of {what}", group, [mine]):
        dist.all_gather(everyone, mine, group=group)
    everyone = torch.stack(everyone).cpu()  # one host read, once per layer
    for rank, theirs in enumerate(everyone):
        if theirs.tolist() != list(values):
            diff = ", ".join(f"{n} {a} vs {b}" for n, a, b in zip(names, values, theirs.tolist()) if a != b)
            raise MoEOptionError(
                f"{what} differs between this worker (rank {group_rank(group)}) and rank {rank}: {diff}; "
                f"build every worker's model with the same flags and world size"
            )
