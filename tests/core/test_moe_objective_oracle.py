"""The router losses against the papers' definitions (tests/support/oracles/router_loss_definitions.py, no
project loss code).

* Balance loss (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): ``E * sum_e f_e * P_e``,
  ``f_e`` the fraction of real tokens whose top-1 choice is ``e`` (top-1 only, also for k=2) and
  ``P_e`` the mean router probability of ``e`` over real tokens.
* Router z-loss (ST-MoE, Zoph et al. 2022): ``mean over real tokens of logsumexp(logits)^2``.

Their gradients w.r.t. the router logits are written in closed form; the closed forms are checked
against finite differences of the definitions by ``gradcheck`` in float64, then the layer's fp32
gradients are checked against them, on random (non-one-hot) routing with padding.
"""

import pytest
import torch

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig
from support.oracles.router_loss_definitions import (
    E,
    router_probabilities,
    st_moe_z_loss,
    st_moe_z_loss_grad,
    switch_balance_loss,
    switch_balance_loss_grad,
    top1_fractions,
)

D, H = 6, 8


class WithClosedFormGradient(torch.autograd.Function):
    """The definition forward, the closed form backward: gradcheck compares the closed form with
    finite differences of the definition."""

    @staticmethod
    def forward(ctx, logits, value, grad):
        ctx.save_for_backward(logits)
        ctx.grad = grad
        return value(logits)

    @staticmethod
    def backward(ctx, upstream):
        (logits,) = ctx.saved_tensors
        return upstream * ctx.grad(logits), None, None


def random_logits(n=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, E, generator=g, dtype=torch.float64)


def test_the_closed_form_balance_loss_gradient_matches_finite_differences_of_its_definition():
    logits = random_logits().requires_grad_()
    top1 = logits.detach().argmax(-1)  # held fixed: f_e is piecewise constant in the logits
    loss = lambda x: WithClosedFormGradient.apply(
        x, lambda l: switch_balance_loss(l, top1), lambda l: switch_balance_loss_grad(l, top1)
    )
    assert torch.autograd.gradcheck(loss, (logits,), eps=1e-6, atol=1e-8)


def test_the_closed_form_z_loss_gradient_matches_finite_differences_of_its_definition():
    logits = (3 * random_logits(seed=1)).requires_grad_()
    loss = lambda x: WithClosedFormGradient.apply(x, st_moe_z_loss, st_moe_z_loss_grad)
    assert torch.autograd.gradcheck(loss, (logits,), eps=1e-6, atol=1e-8)


def routed(k, padded, seed=0):
    """A layer on random tokens: its aux losses, the router logits it computed (retaining their
    gradient; the layer scores pad tokens too and leaves them out of everything after), the same
    logits recomputed here from the router weight and the real tokens, and the real-token rows."""
    torch.manual_seed(seed)
    layer = MoELayer(MoELayerConfig.of(D, H, E, k=k))
    x = torch.randn(3, 7, D)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    if padded:
        mask[0, 4:] = True
        mask[2, 1:] = True
    seen = {}

    def keep_logits(module, inputs, routing):
        routing.logits.retain_grad()
        seen["logits"] = routing.logits

    layer.router.register_forward_hook(keep_logits)
    _, aux = layer.forward_with_aux(x, mask)
    ours = x[~mask].double() @ layer.router.wg.weight.detach().double().t()
    probabilities = router_probabilities(ours)
    assert probabilities.max() < 0.95 and probabilities.min() > 0.01, "routing should be far from one-hot"
    real = ~mask.reshape(-1)
    torch.testing.assert_close(seen["logits"].detach()[real].double(), ours, rtol=1e-5, atol=1e-6)
    return aux, seen["logits"], ours, real


def real_rows_of_gradient(layer_logits, real):
    """The logit gradient of real tokens; a pad token's logits must get none at all."""
    assert not layer_logits.grad[~real].any()
    return layer_logits.grad[real].double()


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("k", [1, 2])
def test_balance_loss_and_its_gradient_are_E_sum_of_top1_fraction_times_mean_prob(k, padded):
    aux, layer_logits, logits, real = routed(k, padded)
    top1 = logits.argmax(-1)
    assert len(set(top1.tolist())) > 1 and top1_fractions(top1, len(top1)).max() < 1
    want = switch_balance_loss(logits, top1)
    torch.testing.assert_close(aux.balance_loss.double(), want, rtol=1e-5, atol=1e-6)
    aux.balance_loss.backward()
    torch.testing.assert_close(
        real_rows_of_gradient(layer_logits, real), switch_balance_loss_grad(logits, top1), rtol=1e-4, atol=1e-7
    )


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("k", [1, 2])
def test_z_loss_and_its_gradient_are_the_real_token_mean_of_squared_logsumexp(k, padded):
    aux, layer_logits, logits, real = routed(k, padded, seed=1)
    torch.testing.assert_close(aux.z_loss.double(), st_moe_z_loss(logits), rtol=1e-5, atol=1e-6)
    aux.z_loss.backward()
    torch.testing.assert_close(
        real_rows_of_gradient(layer_logits, real), st_moe_z_loss_grad(logits), rtol=1e-4, atol=1e-7
    )


def test_the_project_loss_functions_have_the_definitions_gradients_in_float64():
    """gradcheck through the project's sum-based functions given the logits, top-1 held fixed."""
    from fairseq_moe_ext.moe import balance_loss, z_loss

    logits = random_logits(seed=2).requires_grad_()
    top1 = logits.detach().argmax(-1)
    counts = torch.bincount(top1, minlength=E)
    n = torch.tensor(logits.shape[0])
    project_balance = lambda l: balance_loss(torch.softmax(l, -1).sum(0), counts, n)
    project_z = lambda l: z_loss(torch.logsumexp(l, -1).pow(2).sum(), n)
    assert torch.autograd.gradcheck(project_balance, (logits,), eps=1e-6, atol=1e-8)
    assert torch.autograd.gradcheck(project_z, (logits,), eps=1e-6, atol=1e-8)
    torch.testing.assert_close(project_balance(logits), switch_balance_loss(logits, top1))
    torch.testing.assert_close(project_z(logits), st_moe_z_loss(logits))
