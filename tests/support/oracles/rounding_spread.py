"""How close a low-precision step on W workers must be to one process's step in the same precision: within
the rounding that precision shows on this machine, measured tensor by tensor as the distance between one
process's low-precision step and its fp32 step on the same batches.

A fixed fraction of the update does not serve: bf16 and fp16 on a CPU without native bf16 round differently
from one with it, and a tensor whose gradient sums many terms that cancel (a layer norm's weight) keeps few
correct digits in any layout. W workers round on other batch shapes and sum in another order, so they land
about as far from one process's low-precision step as that step is from the fp32 one; a wrong gradient scale
or an average missed moves a tensor by its whole update, and the gradient norm, whose rounding is small,
by far more than its spread.
"""

import torch


def rms(tensor) -> float:
    return float(tensor.double().pow(2).mean().sqrt()) if tensor.numel() else 0.0


def _rows(tensor, like, ep_rank):
    """This worker's experts of a one-process tensor (experts by global id), or the tensor."""
    if tensor.shape == like.shape:
        return tensor
    rows = like.shape[0]
    return tensor[ep_rank * rows : (ep_rank + 1) * rows]


def assert_within_rounding(got, low, fp32, what, ep_rank=0, margin=3.0, floor=0.01):
    """``got``: a worker's step (before/after weights, loss, gnorm); ``low``: one process's in the same precision;
    ``fp32``: one process's in fp32, from the same weights. Each update (and the loss and the norm) is within
    ``margin`` times its own low-precision spread, plus ``floor`` of the update (of the model's largest, for a
    tensor that hardly moves); the loss and the norm plus 1e-3 of themselves."""
    for key in ("loss", "gnorm"):
        spread = abs(low[key] - fp32[key])
        allowed = margin * spread + 1e-3 * abs(low[key])
        assert abs(got[key] - low[key]) <= allowed, f"{what}: {key} {got[key]} vs {low[key]} (fp32 {fp32[key]})"
    assert got["after"].keys() == low["after"].keys(), what
    largest = max(rms(low["after"][n] - low["before"][n]) for n in low["after"])
    assert largest > 0, f"{what}: the reference did not step"
    for name, after in got["after"].items():
        before = _rows(low["before"][name], after, ep_rank)
        assert torch.equal(got["before"][name], before), f"{what}: {name} started elsewhere"
        update = _rows(low["after"][name], after, ep_rank) - before
        update_fp32 = _rows(fp32["after"][name], after, ep_rank) - _rows(fp32["before"][name], after, ep_rank)
        spread = rms(update - update_fp32)
        error = rms(after - got["before"][name] - update)
        allowed = margin * spread + floor * max(rms(update), largest / 100)
        assert error <= allowed, f"{what}: {name} off by {error:.3g} (allowed {allowed:.3g}, spread {spread:.3g})"
