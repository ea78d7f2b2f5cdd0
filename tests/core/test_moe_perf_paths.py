"""The fast paths of the MoE core: the fused expert FFN and gather-only dispatch and combine. Each must give
autograd's exact gradients. (The choice of the grouped-GEMM kernel: test_grouped_mm_choice.py.)"""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig
from fairseq_moe_ext.moe.dispatch import combine_slots, dispatch_slots, inverse_permutation, permute_rows
from fairseq_moe_ext.moe.expert_ffn import expert_ffn
from fairseq_moe_ext.moe.experts import resolve_activation
from fairseq_moe_ext.moe.reference import reference_moe

COUNTS = [3, 0, 5, 1]  # includes an expert without rows


def ffn_inputs(dtype=torch.float64, d=4, h=6, counts=COUNTS, bias=True):
    e, m = len(counts), sum(counts)
    make = lambda *shape: torch.randn(*shape, dtype=dtype, requires_grad=True)  # noqa: E731
    return (
        make(m, d),
        make(e, h, d),
        make(e, h) if bias else None,
        make(e, d, h),
        make(e, d) if bias else None,
    )


def per_expert_linear_ffn(x, counts, w1, b1, w2, b2, activation):
    """What the experts computed before the fused node: F.linear per expert, autograd throughout."""
    outs = []
    for i, rows in enumerate(x.split(counts)):
        h = activation(F.linear(rows, w1[i], None if b1 is None else b1[i]))
        outs.append(F.linear(h, w2[i], None if b2 is None else b2[i]))
    return torch.cat(outs)


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh", "linear"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_expert_ffn_passes_gradcheck(activation, bias):
    act = resolve_activation(activation)
    inputs = [t for t in ffn_inputs(bias=bias)]
    x, w1, b1, w2, b2 = inputs
    if activation == "relu":
        with torch.no_grad():  # keep pre-activations away from ReLU's kink, where finite differences lie
            x.add_(torch.sign(x) * 0.1)
    fn = lambda x, w1, b1, w2, b2: expert_ffn(x, COUNTS, w1, b1, w2, b2, act)  # noqa: E731
    assert gradcheck(fn, (x, w1, b1, w2, b2), eps=1e-6, atol=1e-5)


def test_fused_expert_ffn_with_activation_dropout_passes_gradcheck():
    x, w1, b1, w2, b2 = ffn_inputs()

    def fn(*args):
        torch.manual_seed(7)  # the same dropout mask on every evaluation
        return expert_ffn(args[0], COUNTS, *args[1:], torch.tanh, dropout_p=0.4)

    assert gradcheck(fn, (x, w1, b1, w2, b2), eps=1e-6, atol=1e-5)
    out = fn(x, w1, b1, w2, b2)
    assert torch.equal(out, fn(x, w1, b1, w2, b2))
    assert not torch.allclose(out, expert_ffn(x, COUNTS, w1, b1, w2, b2, torch.tanh))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_fused_expert_ffn_equals_per_expert_linear_in_fp32(activation):
    act = resolve_activation(activation)
    counts = [7, 0, 12, 1, 4]
    x, w1, b1, w2, b2 = ffn_inputs(torch.float32, d=8, h=16, counts=counts)
    upstream = torch.randn(sum(counts), 8)
    results = []
    for fn in (expert_ffn, per_expert_linear_ffn):
        for t in (x, w1, b1, w2, b2):
            t.grad = None
        y = fn(x, counts, w1, b1, w2, b2, act)
        (y * upstream).sum().backward()
        results.append([y.detach()] + [t.grad.clone() for t in (x, w1, b1, w2, b2)])
    for got, want, name in zip(*results, ["y", "x", "w1", "b1", "w2", "b2"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    assert results[0][2][1].abs().sum() == 0, "an expert without rows gets a zero gradient"


def test_fused_expert_ffn_follows_autocast_like_f_linear():
    x, w1, b1, w2, b2 = ffn_inputs(torch.float32, d=8, h=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = expert_ffn(x, COUNTS, w1, b1, w2, b2, F.relu)
        y_ref = per_expert_linear_ffn(x, COUNTS, w1, b1, w2, b2, F.relu)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref)
    y.float().sum().backward()
    assert w1.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_expert_row_counts_must_cover_the_rows():
    x, w1, b1, w2, b2 = ffn_inputs()
    with pytest.raises(ValueError, match="add up to 8, but there are 9 rows"):
        expert_ffn(x, [3, 0, 4, 1], w1, b1, w2, b2, F.relu)


def slot_layout(n, k, num_experts, generator=None):
    expert_index = torch.stack([torch.randperm(num_experts, generator=generator)[:k] for _ in range(n)])
    sorted_slots = torch.argsort(expert_index.reshape(-1), stable=True)
    return sorted_slots, inverse_permutation(sorted_slots)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_dispatch_and_combine_pass_gradcheck_and_equal_index_select(k):
    n, d = 5, 3
    sorted_slots, slot_row = slot_layout(n, k, 4)
    tokens = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: dispatch_slots(t, sorted_slots, slot_row, k), (tokens,))
    torch.testing.assert_close(dispatch_slots(tokens, sorted_slots, slot_row, k), tokens[sorted_slots // k])

    expert_out = torch.randn(n * k, d, dtype=torch.float64, requires_grad=True)
    gates = torch.rand(n, k, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda o, g: combine_slots(o, g, sorted_slots, slot_row), (expert_out, gates))
    want = torch.bmm(gates.unsqueeze(1), expert_out[slot_row].view(n, k, d)).squeeze(1)
    torch.testing.assert_close(combine_slots(expert_out, gates, sorted_slots, slot_row), want)


def test_permute_rows_passes_gradcheck():
    order = torch.randperm(6)
    x = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda x: permute_rows(x, order, inverse_permutation(order)), (x,))
    assert torch.equal(inverse_permutation(order)[order], torch.arange(6))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_layer_with_an_idle_expert_equals_the_reference(activation):
    layer = MoELayer(MoELayerConfig(6, 10, 4, activation=activation))
    with torch.no_grad():  # no token picks expert 3
        layer.router.wg.weight[3].fill_(-100.0)
    x = (torch.randn(9, 6) + 1.0).requires_grad_()  # positive features keep expert 3's score lowest
    y, aux = layer.forward_with_aux(x)
    assert aux.stats["expert_slots"][3] == 0
    y.sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    y_ref, _ = reference_moe(layer, x, activation=resolve_activation(activation))
    y_ref.sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
    assert got["experts.batched_fc1_w"][3].abs().sum() == 0


def test_activation_dropout_is_off_in_eval_and_on_in_training():
    layer = MoELayer(MoELayerConfig(6, 10, 4, activation_dropout=0.5))
    x = torch.randn(9, 6)
    layer.eval()
    torch.testing.assert_close(layer(x), reference_moe(layer, x)[0])
    layer.train()
    torch.manual_seed(3)
    a = layer(x)
    torch.manual_seed(3)
    assert torch.equal(a, layer(x))
    assert not torch.allclose(a, reference_moe(layer, x)[0])
