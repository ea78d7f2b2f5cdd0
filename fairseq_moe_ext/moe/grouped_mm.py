"""The expert matmuls as ``torch._grouped_mm`` calls: one kernel for all experts on recent GPUs.

Which implementation runs the experts is chosen by ``select_expert_matmul``:

* ``"loop"``: one BLAS call per expert (``expert_ffn.py``); the only path on CPU.
* ``"grouped_mm"``: ``torch._grouped_mm`` (CUTLASS grouped GEMM), used under ``"auto"`` only on
  CUDA devices of compute capability 9.x (sm90) and 10.x (sm100 family), in bf16, with 16-byte
  aligned rows: the architectures torch ships the fast kernel for. Elsewhere (8.x, 12.x, ...)
  torch falls back to a slower path, so the loop of per-expert GEMMs wins.
* ``"auto"`` (default): ``grouped_mm`` where it applies, else ``loop``.

``FAIRSEQ_MOE_EXPERT_MATMUL=loop|grouped_mm|auto`` sets the default without code changes (e.g. to
rule the grouped kernel out when chasing a numerical difference on GPU).

``torch._grouped_mm`` is a private op: this module touches it only through ``_GroupedLinear`` and
checks for it by name, so a torch without it silently keeps the loop.

Each product inside ``_GroupedLinear`` goes to the kernel only where the kernel promises to handle
it (``kernel_takes``, a pure function of host values); the rest runs per expert (``_looped``). From
torch's sources (aten/src/ATen/native/GroupedMMUtils.h, cuda/GroupMMCommon.cuh) and its issues:

* every operand's data pointer 16-byte aligned, one of its last two strides 1 and the other at
  least the matching size and a multiple of 16 bytes (else a host error: a view at an odd offset,
  a non-contiguous view);
* the weight gradient (2-D x 2-D, groups along the reduced dimension) only with every group
  non-empty: the kernel asserts on the device (a dead CUDA context, not an exception) where a group
  has no rows unless both layouts happen to suit it, CUTLASS's K=0 groups hang or fail on Hopper
  (NVIDIA/cutlass#2547) and leave garbage on sm100 (NVIDIA/cutlass#2674, pytorch#172439), and a
  row-major operand's group sizes must be multiples of 16 bytes;
* no product over zero rows in total (pytorch#192497: no stride passes the checks), which has
  nothing to compute anyway. Forward and input-gradient products (2-D x 3-D) take empty groups.
"""

import os
from typing import List, NamedTuple, Optional, Tuple, Union

import torch
from torch.autograd.function import once_differentiable

from ..common.refusal import MoEOptionError
from .expert_ffn import bias_grad
from .torch_compat import check_grouped_mm, has_grouped_mm

EXPERT_MATMULS = ("auto", "loop", "grouped_mm")
ENV_VAR = "FAIRSEQ_MOE_EXPERT_MATMUL"
# Compute-capability majors torch's CUTLASS grouped GEMM is built for (sm90, sm100 family); not
# ">= 9": consumer Blackwell (12.x) and later parts take a fallback that loses to the loop.
ACCELERATED_CAPABILITY_MAJORS = (9, 10)


def check_expert_matmul(name: str) -> str:
    if name not in EXPERT_MATMULS:
        raise MoEOptionError(f"unknown expert matmul {name!r}: choose one of {', '.join(EXPERT_MATMULS)}")
    if name == "grouped_mm":
        check_grouped_mm()
    return name


def default_expert_matmul() -> str:
    return check_expert_matmul(os.environ.get(ENV_VAR, "auto"))


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor, capability=None) -> bool:
    """Whether ``"auto"`` picks ``torch._grouped_mm`` for ``x @ weight[i]^T``.

    ``capability`` is the device's (major, minor); read from the device when None (tests pass it).
    """
    if not has_grouped_mm():
        return False
    if x.device.type != "cuda" or weight.device.type != "cuda":
        return False
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if capability is None:
        capability = torch.cuda.get_device_capability(x.device)
    if capability[0] not in ACCELERATED_CAPABILITY_MAJORS:
        return False
    # The kernel reads rows with 16-byte loads: every leading dimension a multiple of 8 bf16.
    return all(size % 8 == 0 for size in (x.shape[-1], weight.shape[-1], weight.shape[-2]))


def select_expert_matmul(preference: str, x: torch.Tensor, weight: torch.Tensor, capability=None) -> str:
    check_expert_matmul(preference)
    if preference != "auto":
        return preference
    return "grouped_mm" if grouped_mm_applies(x, weight, capability) else "loop"


class ExpertGroups(NamedTuple):
    """Where each expert's rows are, on the host and on the device, built once per expert forward."""

    counts: List[int]  # rows per expert, on the host (bias gradients slice by them)
    offsets: torch.Tensor  # int32 [E] end row of each expert, what _grouped_mm takes
    row_expert: torch.Tensor  # int64 [rows] expert of each row (bias addition)
    empty: torch.Tensor  # bool [E] experts without rows (their weight gradient must be exactly zero)


def expert_groups(counts: List[int], device, device_counts: Optional[torch.Tensor] = None) -> ExpertGroups:
    """From ``device_counts`` (the counts already on ``device``) nothing crosses to or from the
    host; without them the host counts are copied over once."""
    if device_counts is None:
        device_counts = torch.tensor(counts, dtype=torch.int64).to(device)
    device_counts = device_counts.to(device=device, dtype=torch.int64)
    row_expert = torch.repeat_interleave(
        torch.arange(len(counts), device=device), device_counts, output_size=sum(counts)
    )
    return ExpertGroups(list(counts), device_counts.cumsum(0).to(torch.int32), row_expert, device_counts == 0)


class Operand(NamedTuple):
    """What the kernel checks of one operand, as host values (``operand_of`` reads them)."""

    data_ptr: int
    sizes: Tuple[int, ...]
    strides: Tuple[int, ...]
    element_size: int


def operand_of(t: torch.Tensor) -> Operand:
    return Operand(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())


def operand_accepted(a: Operand) -> bool:
    """torch's check_valid_strides_and_return_transposed, answered instead of raised."""
    if a.data_ptr % 16 != 0 or len(a.sizes) not in (2, 3):
        return False
    per_16_bytes = max(1, 16 // a.element_size)
    (rows, cols), (row_stride, col_stride) = a.sizes[-2:], a.strides[-2:]
    if row_stride == 1 and col_stride >= max(1, rows):
        return col_stride % per_16_bytes == 0
    if col_stride == 1 and row_stride >= max(1, cols):
        return row_stride % per_16_bytes == 0
    return False


def row_major(a: Operand) -> bool:
    return a.strides[-1] == 1


def kernel_takes(a: Operand, b: Operand, counts: List[int]) -> bool:
    """Whether ``torch._grouped_mm(a, b, offs)`` with groups of ``counts`` rows is a call the kernel
    promises to handle (module docstring); else the product runs per expert."""
    if sum(counts) == 0 or not (operand_accepted(a) and operand_accepted(b)):
        return False
    if len(a.sizes) == 2 and len(b.sizes) == 2:  # weight gradient: groups along the reduced dimension
        per_16_bytes = max(1, 16 // a.element_size)
        misaligned = any(c % per_16_bytes for c in counts[:-1])
        return min(counts) > 0 and not ((row_major(a) or not row_major(b)) and misaligned)
    return True


def _looped(a: torch.Tensor, b: torch.Tensor, counts: List[int]) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs)`` per group: [rows, k] x [E, k, n] -> [rows, n], or
    [n, rows] x [rows, k] -> [E, n, k] (a group without rows gets exact zeros)."""
    if b.dim() == 3:
        out = a.new_empty(a.shape[0], b.shape[-1])
        for i, (rows, out_rows) in enumerate(zip(a.split(counts), out.split(counts))):
            torch.mm(rows, b[i], out=out_rows)
        return out
    out = a.new_empty(len(counts), a.shape[0], b.shape[1])
    for i, (cols, rows) in enumerate(zip(a.split(counts, dim=1), b.split(counts))):
        if rows.shape[0] == 0:
            out[i].zero_()
        else:
            torch.mm(cols, rows, out=out[i])
    return out


def _product(a: torch.Tensor, b: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    if kernel_takes(operand_of(a), operand_of(b), groups.counts):
        return torch._grouped_mm(a, b, offs=groups.offsets)
    return _looped(a, b, groups.counts)


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of i] = x[rows of i] @ weight[i]^T + bias[i]``, weight ``[E, out, in]``."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups):
        x = x.contiguous()
        y = _product(x, weight.transpose(-2, -1), groups)
        if bias is not None:
            y = y + bias.index_select(0, groups.row_expert)
        ctx.save_for_backward(x, weight)
        ctx.groups, ctx.has_bias = groups, bias is not None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        groups = ctx.groups
        grad = grad.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _product(grad, weight, groups)
        if ctx.needs_input_grad[1]:
            # Groups along the reduced dimension: one [out, in] block per expert.
            grad_w = _product(grad.t(), x, groups)
            # An expert without rows must get an exact zero, whatever the kernel leaves there.
            grad_w = grad_w.masked_fill(groups.empty.view(-1, 1, 1), 0)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            # One reduction per expert over its own rows, exactly as the loop path computes it:
            # bit-equal to it, and no atomic adds (index_add_ on CUDA), so runs repeat bit for bit.
            # The counts are on the host already, so slicing costs no device sync.
            grad_b = grad.new_empty(weight.shape[:2])
            for i, rows in enumerate(grad.split(groups.counts)):
                if rows.shape[0] == 0:
                    grad_b[i].zero_()
                else:
                    bias_grad(rows, grad_b[i])
        return grad_x, grad_w, grad_b, None


def grouped_linear(
    x: torch.Tensor, groups: Union[List[int], ExpertGroups], weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    if not isinstance(groups, ExpertGroups):
        groups = expert_groups(groups, x.device)
    if sum(groups.counts) != x.shape[0]:
        raise ValueError(f"expert row counts add up to {sum(groups.counts)}, but there are {x.shape[0]} rows")
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            return _GroupedLinear.apply(x, weight, bias, groups)
    return _GroupedLinear.apply(x, weight, bias, groups)
