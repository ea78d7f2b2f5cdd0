"""fairseq's two mixed-precision wrappers save one optimizer state in two layouts: FP16Optimizer's flat fp32
vector (one entry for every parameter) and per parameter (MemoryEfficientFP16Optimizer, FP16Optimizer
without flattening). ``training/optimizer_layouts.to_layout`` turns one into the other; hook 22 applies it
when a fairseq optimizer loads a state of the other layout (a set resumed under another backend).

The oracle is the optimizer itself: an element-wise optimizer stepping one flat vector and the same
optimizer stepping its pieces take the same steps, so a state converted either way and stepped on must give
bit for bit the weights the unconverted one gives. A state that is not element-wise is left as it was.
"""

import pytest
import torch

from fairseq_moe_ext.training.optimizer_layouts import carries_over, optimizer_mismatch, to_layout

SHAPES = [(3, 4), (5,), (2, 2)]
NUMELS = [12, 5, 4]


def pieces_and_flat(seed=0):
    g = torch.Generator().manual_seed(seed)
    pieces = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in pieces]))
    return pieces, flat


def gradients(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def step(optimizer, params, grads):
    if len(params) == 1:
        grads = [torch.cat([g.reshape(-1) for g in grads])]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.step()


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.01, foreach=False),
    "nag": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, foreach=False),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("direction", ["flat_to_pieces", "pieces_to_flat"])
def test_a_converted_state_steps_on_bit_for_bit_like_the_layout_it_came_from(name, direction):
    pieces, flat = pieces_and_flat()
    saved_params, loaded_params = ([flat], pieces) if direction == "flat_to_pieces" else (pieces, [flat])
    saved = OPTIMIZERS[name](saved_params)
    for i in range(2):
        step(saved, saved_params, gradients(i))
    shapes = [p.shape for p in loaded_params]
    loaded = OPTIMIZERS[name](loaded_params)
    with torch.no_grad():  # the loaded weights: the saved ones in the other layout
        if direction == "flat_to_pieces":
            for p, w in zip(pieces, flat.detach().split(NUMELS)):
                p.copy_(w.view_as(p))
        else:
            flat.copy_(torch.cat([p.detach().reshape(-1) for p in pieces]))
    converted = to_layout(saved.state_dict(), shapes)
    assert converted["param_groups"][0]["params"] == list(range(len(shapes)))
    loaded.load_state_dict(converted)
    step(saved, saved_params, gradients(2))
    step(loaded, loaded_params, gradients(2))
    got = torch.cat([p.detach().reshape(-1) for p in loaded_params])
    want = torch.cat([p.detach().reshape(-1) for p in saved_params])
    assert torch.equal(got, want), f"{name} {direction}: {float((got - want).abs().max())}"


def test_a_state_in_the_layout_already_or_not_element_wise_is_left_as_it_is():
    pieces, _ = pieces_and_flat()
    optimizer = OPTIMIZERS["adam"](pieces)
    step(optimizer, pieces, gradients(0))
    state = optimizer.state_dict()
    assert to_layout(state, SHAPES) is state  # already per parameter
    state["state"][1]["step"] = torch.tensor(7.0)  # steps that differ have no single flat value
    assert to_layout(state, [(sum(NUMELS),)]) is state
    factored = {"state": {0: {"exp_avg_sq_row": torch.zeros(3)}}, "param_groups": [{"params": [0]}]}
    assert to_layout(factored, SHAPES) is factored  # Adafactor's factored moments of a flat vector: not cut


def test_only_the_two_mixed_precision_wrappers_carry_over_and_others_are_refused_in_one_line():
    assert carries_over("FP16Optimizer", "MemoryEfficientFP16Optimizer")
    assert carries_over("MemoryEfficientFP16Optimizer", "FP16Optimizer")
    assert not carries_over("FairseqAdam", "FP16Optimizer") and not carries_over("AMPOptimizer", "FP16Optimizer")
    line = str(optimizer_mismatch("ck/checkpoint_last.pt", "FP16Optimizer", "FairseqAdam"))
    assert "\n" not in line and line.startswith("ck/checkpoint_last.pt holds the state of FP16Optimizer")
    assert "--reset-optimizer" in line and "the learning-rate schedule and the update count" in line


def test_hook_22_loads_a_per_parameter_state_into_a_fairseq_optimizer_over_one_flat_vector():
    """FP16Optimizer's flat fp32 vector needs CUDA to build; the optimizer it wraps does not."""
    from argparse import Namespace

    from fairseq.optim.nag import FairseqNAG

    args = Namespace(lr=[0.1], momentum=0.9, weight_decay=0.0)
    pieces, flat = pieces_and_flat()
    saved = FairseqNAG(args, pieces)
    for p, g in zip(pieces, gradients(0)):
        p.grad = g
    saved.step()
    loaded = FairseqNAG(args, [flat])
    loaded.load_state_dict(saved.state_dict())  # one state of 21 elements, not three
    buffers = [saved.optimizer.state[p]["momentum_buffer"].reshape(-1) for p in pieces]
    assert torch.equal(loaded.optimizer.state[flat]["momentum_buffer"], torch.cat(buffers))
