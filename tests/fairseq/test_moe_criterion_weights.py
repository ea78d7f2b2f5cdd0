"""``--moe-gate-loss-wt`` and ``--moe-z-loss-wt`` each add exactly ``weight x term x sample_size`` to
the training loss, and its gradient to every parameter, and nothing else.

The terms come from the definitions in router_loss_definitions (GShard/Switch balance loss,
ST-MoE z-loss), evaluated on every router's input tokens as the model saw them, so their
gradients reach the router weights directly and, through the first MoE layer's output, the
parameters below the second. A detached or missing term changes the difference, not only its sign.
"""

import pytest
import torch

from fairseq_moe_ext.moe import MoELayer, TopKRouter
from support.inputs.tiny_fairseq_models import translation, translation_batch
from support.oracles.router_loss_definitions import E, st_moe_z_loss, switch_balance_loss

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")

GATE_WT, Z_WT = 2.5, 0.7


def step(built, sample, criterion):
    """Loss, sample size, logging output and gradients of one training forward/backward, and the
    oracle's balance and z terms (combined by averaging over layers) with their gradients."""
    model = built.model
    model.train()
    model.zero_grad()
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == 2 and all(r.num_experts == E and r.gate_noise == 0 for r in routers)
    tokens, chosen = [], []

    def record(router, inputs, routing):  # returns None: the routing goes on unchanged
        tokens.append((router, inputs[0]))
        chosen.append(routing)

    reals = []  # which rows each layer counts as real tokens (the router scores pads too)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:

        def route_tokens(tokens, real=None, _route=layer.route_tokens):
            reals.append(torch.ones(tokens.shape[0], dtype=torch.bool) if real is None else real)
            return _route(tokens, real)

        layer.route_tokens = route_tokens

    hooks = [r.register_forward_hook(record) for r in routers]
    try:
        loss, sample_size, log = criterion(model, sample)
    finally:
        for h in hooks:
            h.remove()
        for layer in layers:
            del layer.route_tokens
    balance, z = [], []
    for (router, x), routing, real in zip(tokens, chosen, reals):
        logits = x[real].float() @ router.wg.weight.float().t()
        top1 = logits.detach().argmax(-1)
        assert torch.equal(top1, routing.expert_index[real, 0])
        balance.append(switch_balance_loss(logits, top1))
        z.append(st_moe_z_loss(logits))
    terms = {"balance": torch.stack(balance).mean(), "z": torch.stack(z).mean()}
    params = [p for p in model.parameters() if p.requires_grad]
    term_grads = {
        name: torch.autograd.grad(term, params, retain_graph=True, allow_unused=True) for name, term in terms.items()
    }
    loss.backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return dict(
        loss=loss.item(),
        sample_size=sample_size,
        log=log,
        grads=dict(zip(names, grads)),
        terms={k: v.item() for k, v in terms.items()},
        term_grads={
            k: dict(zip(names, (torch.zeros_like(p) if g is None else g for g, p in zip(gs, params))))
            for k, gs in term_grads.items()
        },
    )


@pytest.fixture(scope="module")
def unweighted(data):
    """The model, a batch, and one step at weights (0, 0)."""
    built = translation(
        data,
        "--criterion",
        "moe_label_smoothed_cross_entropy",
        "--label-smoothing",
        "0.1",
        "--moe-gate-loss-wt",
        "0",
        "--moe-z-loss-wt",
        "0",
    )
    sample = translation_batch(built.task)
    return built, sample, step(built, sample, built.criterion)


def criterion_with_weights(built, gate, z):
    """The criterion fairseq builds from the same flags and these two weights."""
    return type(built.criterion)(
        built.task, built.criterion.sentence_avg, built.criterion.eps, moe_gate_loss_wt=gate, moe_z_loss_wt=z
    )


@pytest.mark.parametrize(
    "term, weights", [("balance", (GATE_WT, 0)), ("z", (0, Z_WT))], ids=["gate-loss-wt", "z-loss-wt"]
)
def test_each_loss_weight_adds_weight_times_term_times_sample_size_to_loss_and_grads(unweighted, term, weights):
    built, sample, base = unweighted
    weighted = step(built, sample, criterion_with_weights(built, *weights))
    weight = max(weights)
    scale = weight * base["sample_size"]

    assert weighted["log"]["loss"] == base["log"]["loss"] and weighted["log"]["nll_loss"] == base["log"]["nll_loss"]
    assert base["terms"] == weighted["terms"]
    assert weighted["loss"] - base["loss"] == pytest.approx(scale * base["terms"][term], rel=1e-4)
    routers = [n for n in base["grads"] if n.endswith("router.wg.weight")]
    assert len(routers) == 2
    for name, got in weighted["grads"].items():
        want = scale * base["term_grads"][term][name]
        if name in routers:
            assert want.abs().max() > 1e-3 * base["grads"][name].abs().max(), f"{term} should move {name}"
        # fp32 rounding of the two backward passes; the floor covers gradients that are zero in exact
        # arithmetic (a key projection's bias) and come out as noise of ~1e-8.
        tolerance = 1e-4 * max(float(base["grads"][name].abs().max()), float(want.abs().max())) + 2e-7
        torch.testing.assert_close(
            got - base["grads"][name], want, rtol=1e-3, atol=tolerance, msg=lambda m: f"{name}: {m}"
        )
