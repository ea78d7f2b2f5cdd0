"""Which matmul the experts run: the grouped-GEMM kernel (``torch._grouped_mm``) only where torch promises to
handle the call, the per-expert loop everywhere else, and both giving the same values and gradients."""

import types

import pytest
import torch

from fairseq_moe_ext.moe import BatchedExperts
from fairseq_moe_ext.moe import grouped_mm as gm


def fake(device_type, dtype, *shape):
    return types.SimpleNamespace(device=types.SimpleNamespace(type=device_type), dtype=dtype, shape=shape)


def test_auto_picks_grouped_mm_only_on_recent_gpus_in_bf16_with_aligned_shapes():
    bf16 = torch.bfloat16
    pick = lambda x, w, cap=(9, 0), pref="auto": gm.select_expert_matmul(pref, x, w, cap)  # noqa: E731
    x, w = fake("cuda", bf16, 64, 512), fake("cuda", bf16, 8, 2048, 512)
    # Only the architectures torch builds the CUTLASS grouped GEMM for (sm90, sm100 family).
    for capability, path in [
        ((8, 0), "loop"),
        ((8, 9), "loop"),
        ((9, 0), "grouped_mm"),
        ((10, 0), "grouped_mm"),
        ((10, 3), "grouped_mm"),
        ((11, 0), "loop"),
        ((12, 0), "loop"),
    ]:
        assert pick(x, w, cap=capability) == path, capability
    assert pick(fake("cuda", torch.float32, 64, 512), fake("cuda", torch.float32, 8, 2048, 512)) == "loop"
    assert pick(fake("cuda", bf16, 64, 500), fake("cuda", bf16, 8, 2048, 500)) == "loop"
    assert pick(fake("cpu", bf16, 64, 512), fake("cpu", bf16, 8, 2048, 512)) == "loop"
    assert pick(x, w, pref="loop") == "loop"
    assert pick(fake("cpu", bf16, 4, 4), fake("cpu", bf16, 2, 4, 4), pref="grouped_mm") == "grouped_mm"
    with pytest.raises(ValueError, match="unknown expert matmul 'cutlass'"):
        pick(x, w, pref="cutlass")


def test_auto_never_picks_grouped_mm_without_the_op(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    x, w = fake("cuda", torch.bfloat16, 64, 512), fake("cuda", torch.bfloat16, 8, 2048, 512)
    assert gm.select_expert_matmul("auto", x, w, (9, 0)) == "loop"


def test_cpu_experts_take_the_loop_and_the_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(gm.ENV_VAR, raising=False)
    experts = BatchedExperts(8, 16, 2)
    assert experts.matmul == "auto"
    assert gm.select_expert_matmul(experts.matmul, torch.randn(3, 8), experts.batched_fc1_w) == "loop"
    monkeypatch.setenv(gm.ENV_VAR, "loop")
    assert BatchedExperts(8, 16, 2).matmul == "loop"
    monkeypatch.setenv(gm.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="unknown expert matmul 'fast'"):
        BatchedExperts(8, 16, 2)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_grouped_mm_experts_equal_the_loop_where_torch_runs_the_op():
    # On CPU torch runs _grouped_mm with a reference implementation: this checks our use of it
    # (layouts, offsets, bias, gradients, idle experts), not the CUDA kernel's speed.
    counts = [5, 0, 8, 3]
    loop = BatchedExperts(16, 32, 4, matmul="loop", activation="gelu")
    grouped = BatchedExperts(16, 32, 4, matmul="grouped_mm", activation="gelu")
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(sum(counts), 16)
    upstream = torch.randn(sum(counts), 16)
    results = []
    for experts in (loop, grouped):
        xi = x.clone().requires_grad_()
        y = experts(xi, counts)
        (y * upstream).sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad for p in experts.parameters()])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert results[1][2][1].abs().sum() == 0


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_mm_output_bias_gradient_is_bit_equal_to_the_loop_path_for_long_row_runs(dtype):
    # The output bias sees the same upstream gradient on both paths, so its gradient must be the
    # same bits: one reduction per expert, the loop's, not an index_add over all rows.
    counts = [700, 0, 1500, 1, 333]
    loop = BatchedExperts(16, 32, len(counts), matmul="loop").to(dtype)
    grouped = BatchedExperts(16, 32, len(counts), matmul="grouped_mm").to(dtype)
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(sum(counts), 16, dtype=dtype)
    upstream = torch.randn(sum(counts), 16, dtype=dtype)
    for experts in (loop, grouped):
        (experts(x, counts) * upstream).sum().backward()
    assert torch.equal(grouped.batched_fc2_b.grad, loop.batched_fc2_b.grad)
    assert grouped.batched_fc2_b.grad[1].abs().sum() == 0 and grouped.batched_fc1_b.grad[1].abs().sum() == 0


class PromisingGroupedKernel:
    """A stand-in for ``torch._grouped_mm`` on CUDA that asserts what the kernel promises to handle
    (written from torch's GroupedMMUtils.h and cuda/GroupMMCommon.cuh, independently of the code
    under test), then computes per group in fp64. ``calls`` counts what reached it."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def check_operand(name, t):
        assert t.data_ptr() % 16 == 0, f"{name}: data pointer not 16-byte aligned"
        per_16_bytes = 16 // t.element_size()
        (rows, cols), (row_stride, col_stride) = t.shape[-2:], t.stride()[-2:]
        if row_stride == 1 and col_stride >= max(1, rows):
            assert col_stride % per_16_bytes == 0, f"{name}: stride {col_stride} not a multiple of 16 bytes"
        elif col_stride == 1 and row_stride >= max(1, cols):
            assert row_stride % per_16_bytes == 0, f"{name}: stride {row_stride} not a multiple of 16 bytes"
        else:
            raise AssertionError(f"{name}: invalid strides {t.stride()} for sizes {tuple(t.shape)}")

    def __call__(self, a, b, offs=None):
        self.check_operand("mat_a", a)
        self.check_operand("mat_b", b)
        assert offs is not None and offs.dtype == torch.int32 and offs.dim() == 1
        ends = offs.tolist()
        sizes = [end - start for start, end in zip([0] + ends[:-1], ends)]
        assert ends[-1] > 0, "no rows in total: no stride passes torch's checks (pytorch#192497)"
        if a.dim() == 2 and b.dim() == 2:
            # Groups along the reduced dimension: K = 0 is a device-side assert, a hang or garbage.
            assert min(sizes) > 0, f"an empty group in the weight gradient: {sizes}"
            self.calls.append("weight gradient")
            blocks = [a[:, s - n : s].double() @ b[s - n : s].double() for n, s in zip(sizes, ends)]
            return torch.stack(blocks).to(a.dtype)
        self.calls.append("rows")
        return torch.cat([a[s - n : s].double() @ b[i].double() for i, (n, s) in enumerate(zip(sizes, ends))]).to(
            a.dtype
        )


def misaligned(t):
    """``t``'s values in a contiguous tensor whose data starts 4 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
    return flat.view(t.shape).copy_(t)


# fmt: off
GROUPED_EDGE_CASES = {  # name: (counts, input maker, upstream gradient maker)
    "empty groups": ([5, 0, 8, 3], torch.clone, torch.clone),
    "every row on one expert": ([0, 16, 0, 0], torch.clone, torch.clone),
    "no rows at all": ([0, 0, 0, 0], torch.clone, torch.clone),
    "busy experts only": ([4, 8, 2, 2], torch.clone, torch.clone),
    "misaligned input": ([4, 8, 2, 2], misaligned, torch.clone),
    "misaligned upstream gradient": ([4, 8, 2, 2], torch.clone, misaligned),
    "non-contiguous upstream gradient": ([4, 8, 2, 2], torch.clone, lambda g: torch.cat([g, g], 1)[:, ::2]),
}
# fmt: on


@pytest.mark.parametrize("case", GROUPED_EDGE_CASES)
def test_the_grouped_kernel_gets_only_calls_it_handles_and_the_rest_equals_the_loop(monkeypatch, case):
    counts, make_input, make_upstream = GROUPED_EDGE_CASES[case]
    kernel = PromisingGroupedKernel()
    monkeypatch.setattr(torch, "_grouped_mm", kernel, raising=False)
    loop = BatchedExperts(16, 32, 4, matmul="loop", activation="gelu")
    grouped = BatchedExperts(16, 32, 4, matmul="grouped_mm", activation="gelu")
    grouped.load_state_dict(loop.state_dict())
    g = torch.Generator().manual_seed(5)
    x, upstream = torch.randn(sum(counts), 16, generator=g), torch.randn(sum(counts), 16, generator=g)
    results = []
    for experts in (loop, grouped):
        xi = make_input(x).requires_grad_()
        experts(xi, counts).backward(make_upstream(upstream))
        results.append([xi.grad] + [p.grad for p in experts.parameters()])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for i, rows in enumerate(counts):
        if rows == 0:  # an idle expert's gradient is an exact zero, on either path
            assert all(p.grad[i].abs().sum() == 0 for p in grouped.parameters())
    if case == "busy experts only":  # what the kernel can do, it still does
        assert kernel.calls == ["rows"] * 2 + ["rows", "weight gradient"] * 2, kernel.calls


def operand(sizes, strides, data_ptr=0, element_size=2):
    return gm.Operand(data_ptr, tuple(sizes), tuple(strides), element_size)


ROWS = operand([24, 16], [16, 1])  # tokens x model dim, bf16, row-major
WEIGHTS_T = operand([4, 16, 32], [512, 1, 16])  # experts x in x out, a transposed [E, out, in]


@pytest.mark.parametrize(
    "a, b, counts, takes",
    [
        (ROWS, WEIGHTS_T, [8, 8, 8, 0], True),  # forward / input gradient: empty groups are fine
        (ROWS, WEIGHTS_T, [0, 0, 0, 0], False),  # nothing to compute
        (operand([24, 16], [16, 1], data_ptr=8), WEIGHTS_T, [8, 8, 8, 0], False),  # 8 bytes off alignment
        (operand([24, 12], [12, 1]), operand([4, 12, 32], [384, 1, 12]), [8, 8, 8, 0], False),  # rows of 24 bytes
        (operand([24, 16], [1, 24]), WEIGHTS_T, [8, 8, 8, 0], True),  # column-major, 48-byte leading stride
        (operand([24, 16], [32, 2]), WEIGHTS_T, [8, 8, 8, 0], False),  # no unit stride
        (operand([32, 24], [1, 32]), ROWS, [8, 8, 5, 3], True),  # weight gradient: grad^T x rows, busy groups
        (operand([32, 24], [1, 32]), ROWS, [8, 8, 8, 0], False),  # ... an empty group
        (operand([32, 24], [24, 1]), ROWS, [8, 5, 8, 3], False),  # row-major grad: group of 10 bytes
        (operand([32, 24], [24, 1]), ROWS, [8, 8, 8, 3], True),  # ... only the last group may be ragged
    ],
    ids=lambda v: "" if isinstance(v, gm.Operand) else str(v),
)
def test_the_grouped_kernel_takes_a_product_only_where_torch_promises_to_handle_it(a, b, counts, takes):
    assert gm.kernel_takes(a, b, counts) is takes
