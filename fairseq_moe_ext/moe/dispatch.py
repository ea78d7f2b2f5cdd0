"""Moving token-slots into expert order and back, with backwards that gather instead of scatter.

In dropless routing every one of the ``N * k`` slots is served, so sorting slots by expert is a
permutation. Autograd's ``index_select`` backward is a scatter-add into a zero-filled tensor (slow
and single-threaded on CPU, and run-to-run nondeterministic on CUDA, where it adds with atomics);
for a permutation the same gradient is a gather through the inverse permutation, which is what
these functions do. With capacity, dropped slots read a zero row instead, so no path of the layer
accumulates with atomics. Their gradients are exactly autograd's: each
output gradient row is copied or summed into its source row, only the memory access pattern changes.

Terms: slot ``s = t * k + j`` is token ``t``'s ``j``-th choice; ``sorted_slots[r]`` is the slot at
row ``r`` of the expert-ordered layout; ``slot_row`` is its inverse (the row of each slot).
"""

import torch
from torch.autograd.function import once_differentiable


def bucket_counts(index: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``torch.bincount(index, minlength=num_buckets)`` for ``index < num_buckets``, without the
    device sync CUDA's bincount does to size its output by ``index.max()`` (the size is known
    here) and without atomic adds (``scatter_add_``): a sum over a ``[len(index), num_buckets]``
    comparison, a plain reduction, which is exact and repeats bit for bit."""
    buckets = torch.arange(num_buckets, device=index.device)
    return (index.reshape(-1, 1) == buckets).sum(0)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


def served_slot_rows(sorted_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``slot_row`` when only ``sorted_slots`` are served: dropped slots get the row past the end."""
    slot_row = torch.full((num_slots,), sorted_slots.numel(), dtype=sorted_slots.dtype, device=sorted_slots.device)
    slot_row[sorted_slots] = torch.arange(sorted_slots.numel(), device=sorted_slots.device)
    return slot_row


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[order]`` where ``order`` is a permutation and ``inverse`` its inverse."""
    return _PermuteRows.apply(x, order, inverse)


class _DispatchSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, sorted_slots, slot_row, k):
        ctx.save_for_backward(slot_row)
        ctx.k = k
        ctx.dropped = sorted_slots.numel() < slot_row.numel()
        return tokens.index_select(0, torch.div(sorted_slots, k, rounding_mode="floor"))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (slot_row,) = ctx.saved_tensors
        k = ctx.k
        if ctx.dropped:  # dropped slots read the zero row appended after the served ones
            grad = torch.cat([grad, grad.new_zeros(1, grad.shape[-1])])
        per_slot = grad.index_select(0, slot_row)  # token-major: token t's k slots are adjacent
        if k == 1:
            return per_slot, None, None, None
        per_slot = per_slot.view(-1, k, grad.shape[-1])
        # An explicit sum over the k choices, in choice order: reducing the middle axis of a
        # [N, k, d] tensor with sum(1) is several times slower on CPU.
        total = per_slot[:, 0].clone()
        for j in range(1, k):
            total.add_(per_slot[:, j])
        return total, None, None, None


def dispatch_slots(tokens: torch.Tensor, sorted_slots: torch.Tensor, slot_row: torch.Tensor, k: int) -> torch.Tensor:
    """Row ``r`` of the result is the token of slot ``sorted_slots[r]``. ``slot_row`` gives every
    one of the ``N * k`` slots its row; slots that were dropped (capacity) point to row
    ``len(sorted_slots)``, one past the last (see ``served_slot_rows``)."""
    return _DispatchSlots.apply(tokens, sorted_slots, slot_row, k)


class _CombineSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, gates, sorted_slots, slot_row):
        n, k = gates.shape
        slots = expert_out.index_select(0, slot_row).view(n, k, expert_out.shape[-1])
        y = slots[:, 0] * gates[:, :1]
        for j in range(1, k):
            y.addcmul_(slots[:, j], gates[:, j : j + 1])
        ctx.save_for_backward(expert_out, gates, sorted_slots, slot_row)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        expert_out, gates, sorted_slots, slot_row = ctx.saved_tensors
        n, k = gates.shape
        grad_y = grad_y.contiguous()
        grad_out = grad_gates = None
        if ctx.needs_input_grad[0]:
            # Row r holds slot s = sorted_slots[r]: gradient gates[s] * grad_y[token of s].
            grad_out = grad_y.index_select(0, torch.div(sorted_slots, k, rounding_mode="floor"))
            grad_out.mul_(gates.reshape(-1).index_select(0, sorted_slots).unsqueeze(1))
        if ctx.needs_input_grad[1]:
            slots = expert_out.index_select(0, slot_row).view(n, k, expert_out.shape[-1])
            grad_gates = torch.bmm(slots, grad_y.unsqueeze(2)).squeeze(2)
        return grad_out, grad_gates, None, None


def combine_slots(
    expert_out: torch.Tensor, gates: torch.Tensor, sorted_slots: torch.Tensor, slot_row: torch.Tensor
) -> torch.Tensor:
    """``y[t] = sum_j gates[t, j] * expert_out[slot_row[t * k + j]]`` for ``[N, k]`` gates."""
    return _CombineSlots.apply(expert_out, gates.to(expert_out.dtype), sorted_slots, slot_row)


def through_experts(tokens, order, slot_expert, gates, served: int, num_experts: int, experts):
    """The MoE output ``[N, d]`` of ``tokens [N, d]``: their ``N * k`` slots (token-major: slot ``t * k + j`` is
    token ``t``'s ``j``-th choice; ``slot_expert`` its expert, ``num_experts`` for one that is not served, a pad's
    or a dropped one) are gathered in expert ``order`` (``argsort(slot_expert)``, the ``served`` ones first),
    ``experts`` maps those rows to their outputs, and each token sums its slots' outputs weighted by ``gates``
    ``[N, k]``."""
    n, k = gates.shape
    if served == n * k:
        # Dropless: sorting is a permutation of all slots, so both directions are gathers.
        slot_row = inverse_permutation(order)
        expert_out = experts(dispatch_slots(tokens, order, slot_row, k))
        return combine_slots(expert_out, gates, order, slot_row)
    sorted_slots = order[:served]  # unserved slots sort last and are cut off
    slot_row = served_slot_rows(sorted_slots, n * k)  # unserved slots: row `served`, past the end
    expert_out = experts(dispatch_slots(tokens, sorted_slots, slot_row, k))
    if served == 0:  # nothing routed here (only padding: fairseq's dummy batch)
        # Zeros that still depend on expert_out: its backward is this rank's share of the
        # all-to-all backward, which every rank must issue.
        return expert_out.new_zeros(n, tokens.shape[-1]) + expert_out.sum()
    # Combine as in the dropless path, with unserved slots (dropped, pads) reading any
    # served row (row 0) at gate exactly 0: their term adds exactly zero.
    served_mask = slot_expert < num_experts
    slot_row = torch.where(served_mask, slot_row, 0)
    return combine_slots(expert_out, gates * served_mask.view(n, k), sorted_slots, slot_row)
