"""All local experts' feed-forward networks as one autograd node.

``y_i = act(x_i @ W1_i^T + b1_i) * dropout_mask_i @ W2_i^T + b2_i`` for the row segment ``x_i`` of
each expert, with the weights stacked as ``[E, out, in]``.

Why one hand-written node instead of per-expert ``F.linear`` calls: autograd would concatenate the
per-expert outputs, stack E per-expert weight gradients into the stacked gradient (a copy of every
expert weight), concatenate the input gradients, and allocate a fresh ``[rows, hidden]`` tensor for
every elementwise step. Here every expert writes straight into one preallocated output, the weight
gradients are born in their stacked layout, ReLU runs in place, and the backward works through the
hidden activations one expert at a time, so its largest temporary is one expert's
``[rows_i, hidden]`` block. Freshly allocated large tensors are expensive on CPU (the kernel zeroes
every page on first touch), which is where most of the time went.

The gradients are the exact ones autograd computes for the composed ops (same matmuls, same
order of reductions per expert); tests check this in float64 with ``gradcheck`` and against a
per-expert ``F.linear`` reference.
"""

from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .torch_compat import relu_backward_

_RELU = (F.relu, torch.relu)


def is_relu(activation: Callable) -> bool:
    return activation in _RELU


def _segments(counts: List[int]):
    start = 0
    for i, count in enumerate(counts):
        yield i, start, start + count
        start += count


def _affine(x, weight, bias, out):
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def bias_grad(grad: torch.Tensor, out: torch.Tensor) -> None:
    # A matrix-vector product with ones: BLAS runs it an order of magnitude faster than sum(0).
    torch.mv(grad.t(), grad.new_ones(grad.shape[0]), out=out)


class _ExpertFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, counts, activation, dropout_p):
        x = x.contiguous()
        relu = is_relu(activation)
        rows, hidden = x.shape[0], w1.shape[1]
        # pre: fc1 outputs (after ReLU in place when the activation is ReLU: ReLU's gradient needs
        # only the sign of its output). Other activations are recomputed from pre in backward.
        pre = x.new_empty(rows, hidden)
        out = x.new_empty(rows, w2.shape[1])
        mask = torch.empty(rows, hidden, dtype=torch.bool, device=x.device) if dropout_p > 0 else None
        for i, start, end in _segments(counts):
            if start == end:
                continue
            a = _affine(x[start:end], w1[i], None if b1 is None else b1[i], pre[start:end])
            h = torch.relu_(a) if relu else activation(a)
            if mask is not None:
                # native_dropout's arithmetic: input * bernoulli(1 - p) mask * 1 / (1 - p).
                h = h * mask[start:end].bernoulli_(1 - dropout_p)
                h.mul_(1.0 / (1.0 - dropout_p))
            _affine(h, w2[i], None if b2 is None else b2[i], out[start:end])
        ctx.save_for_backward(x, w1, w2, pre, mask)
        ctx.counts, ctx.activation, ctx.relu, ctx.dropout_p = counts, activation, relu, dropout_p
        ctx.has_bias = (b1 is not None, b2 is not None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, w1, w2, pre, mask = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        grad_x = torch.empty_like(x) if need_x else None
        grad_w1 = torch.empty_like(w1) if need_w1 else None
        grad_w2 = torch.empty_like(w2) if need_w2 else None
        grad_b1 = w1.new_empty(w1.shape[:2]) if need_b1 else None
        grad_b2 = w2.new_empty(w2.shape[:2]) if need_b2 else None
        scale = 1.0 / (1.0 - ctx.dropout_p)
        for i, start, end in _segments(ctx.counts):
            if start == end:
                # An expert that got no rows still has a (zero) gradient, as in autograd.
                for grad in (grad_w1, grad_w2, grad_b1, grad_b2):
                    if grad is not None:
                        grad[i].zero_()
                continue
            g, a = grad_out[start:end], pre[start:end]
            with torch.enable_grad():
                if ctx.relu:
                    h = a
                else:
                    a = a.detach().requires_grad_()
                    h = ctx.activation(a)
            h_in = h.detach()
            if mask is not None:
                h_in = h_in * mask[start:end]
                h_in.mul_(scale)
            if need_w2:
                torch.mm(g.t(), h_in, out=grad_w2[i])
            if need_b2:
                bias_grad(g, grad_b2[i])
            del h_in
            grad_h = torch.mm(g, w2[i])
            if mask is not None:
                grad_h.mul_(mask[start:end]).mul_(scale)
            if ctx.relu:
                relu_backward_(grad_h, h)
                grad_a = grad_h
            else:
                (grad_a,) = torch.autograd.grad(h, a, grad_h)
            if need_w1:
                torch.mm(grad_a.t(), x[start:end], out=grad_w1[i])
            if need_b1:
                bias_grad(grad_a, grad_b1[i])
            if need_x:
                torch.mm(grad_a, w1[i], out=grad_x[start:end])
        if grad_b1 is not None and not ctx.has_bias[0]:
            grad_b1 = None
        if grad_b2 is not None and not ctx.has_bias[1]:
            grad_b2 = None
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None


def expert_ffn(
    x: torch.Tensor,
    counts: List[int],
    w1: torch.Tensor,
    b1: Optional[torch.Tensor],
    w2: torch.Tensor,
    b2: Optional[torch.Tensor],
    activation: Callable,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Rows of ``x`` sorted by expert, ``counts[i]`` of them for expert ``i``; ``dropout_p`` is the
    activation dropout to apply (pass 0 outside training)."""
    if sum(counts) != x.shape[0]:
        raise ValueError(f"expert row counts add up to {sum(counts)}, but there are {x.shape[0]} rows")
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        # What F.linear does under autocast: matmuls in the autocast dtype. The casts stay outside
        # the Function so that autograd carries gradients back to the fp32 parameters.
        dtype = torch.get_autocast_dtype(device_type)
        x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
        b1 = b1.to(dtype) if b1 is not None else None
        b2 = b2.to(dtype) if b2 is not None else None
        with torch.autocast(device_type, enabled=False):
            return _ExpertFFN.apply(x, w1, b1, w2, b2, list(counts), activation, float(dropout_p))
    return _ExpertFFN.apply(x, w1, b1, w2, b2, list(counts), activation, float(dropout_p))
