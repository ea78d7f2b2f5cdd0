"""With ``--moe-gating-no-fp32`` the router runs in the activation dtype; the token counts and
totals behind the losses and the capacity must not: fp16 stops at 65,504 (16 GPUs x 4096 tokens)
and bf16 has 8 significant bits (1001 counts as 1000)."""

import pytest
import torch

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig

D, H, E, K = 8, 16, 4, 2


def half_router_layer(dtype, **kwargs):
    torch.manual_seed(0)
    return MoELayer(MoELayerConfig.of(D, H, E, k=K, fp32=False, **kwargs), seed=3).to(dtype)


def fp64_losses(layer, x):
    """Balance and z-loss from the layer's own half-precision routing, totalled in fp64."""
    with torch.no_grad():
        routing = layer.router(x)
    n = x.shape[0]
    probs = routing.probs.double()
    top1 = torch.bincount(routing.expert_index[:, 0], minlength=E).double()
    balance = E * torch.sum((probs.sum(0) / n) * (top1 / n))
    z = torch.logsumexp(routing.logits.double(), dim=-1).pow(2).sum() / n
    return balance, z


@pytest.mark.parametrize("dtype, tokens", [(torch.float16, 70_000), (torch.bfloat16, 1001)], ids=str)
def test_a_half_precision_router_totals_tokens_exactly_so_its_losses_match_an_fp64_reference(dtype, tokens):
    layer = half_router_layer(dtype)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    _, aux = layer.forward_with_aux(x)
    balance, z = fp64_losses(layer, x)
    assert torch.isfinite(aux.balance_loss) and torch.isfinite(aux.z_loss)
    torch.testing.assert_close(aux.balance_loss.double(), balance, rtol=1e-5, atol=0)
    torch.testing.assert_close(aux.z_loss.double(), z, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype, tokens", [(torch.float16, 70_000), (torch.bfloat16, 1001)], ids=str)
def test_a_half_precision_router_sizes_expert_capacity_from_the_exact_token_count(dtype, tokens):
    # Every token picks the same two experts, so exactly 2 * (tokens - capacity / 2) slots are
    # dropped, where capacity = 2 * ceil(tokens / 4): a count off by one token changes it.
    layer = half_router_layer(dtype, capacity_factor=1.0)
    with torch.no_grad():
        layer.router.wg.weight.zero_()
        layer.router.wg.weight[:2] = 1.0
    x = torch.rand(tokens, D, generator=torch.Generator().manual_seed(2)).add(0.5).to(dtype)
    _, aux = layer.forward_with_aux(x)
    capacity = K * -(-tokens // E)
    assert aux.stats["dropped_slots"].item() == K * (tokens - capacity)
    assert aux.stats["expert_slots"][:2].tolist() == [tokens, tokens]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_half_precision_router_logs_the_fp64_entropy_of_real_tokens_despite_padding(dtype):
    # Pad tokens' probabilities are zeroed before the entropy; 0 * log(clamp(0, 1e-20)) must stay 0,
    # but 1e-20 is 0 in fp16 (and a sharp router's small probabilities underflow there too).
    layer = half_router_layer(dtype)
    with torch.no_grad():
        layer.router.wg.weight.mul_(40.0)  # sharp: some probabilities underflow to 0 in fp16
    x = torch.randn(6, 5, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    padding = torch.zeros(6, 5, dtype=torch.bool)
    padding[1, 3:] = padding[4, 1:] = True
    _, aux = layer.forward_with_aux(x, padding)
    with torch.no_grad():
        probs = layer.router(x.reshape(-1, D)).probs.double()[~padding.reshape(-1)]
    want = -torch.special.xlogy(probs, probs).sum()
    got = aux.stats["router_entropy_sum"]
    assert torch.isfinite(got), got
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
