"""One or two logged training steps in a given precision, read as fp32 master weights, for the
mixed-precision oracles of ``--ddp-backend fully_sharded`` (tests/parallel/test_fully_sharded_precision.py).

The weights an optimizer steps are what is compared: fairseq's FP16Optimizer (legacy_ddp and one
process with ``--bf16`` / ``--fp16``) keeps fp32 copies apart from the low-precision model, while
fully_sharded steps the model's fp32 shards and fp32 experts in place.
"""

from itertools import chain

import torch

from support.inputs.gradient_overflow import inject_once_into_first_experts
from support.launch.in_process_trainer import build_trainer, collate, sentence_pairs, training_args

# fairseq's NAG keeps a momentum buffer per parameter (one fp32 buffer: its bytes are counted), and
# its first update is proportional to the gradient, so a wrong gradient scale shows.
NAG = ["--optimizer", "nag", "--momentum", "0.9", "--lr", "0.1"]

# The precision's flags and the tolerance two runs of one step are held to. A low precision's is ROUNDOFFS of its
# unit roundoff u (half the gap from 1 to the next number: bf16 keeps 8 significant bits, fp16 11): one process and W
# workers round each gradient element after another sum of the batch's tokens (one batch, or W partial sums reduced
# over the workers), which moves it by about u times its scale in the root mean square, whatever the CPU's kernels.
# --amp computes in fp32 on the CPU: the fp32 oracles' tolerance.
ROUNDOFFS = 4
# fmt: off
PRECISIONS = {
    "bf16": (["--bf16"], ROUNDOFFS * 2.0**-8),
    # fairseq's flattened fp16 needs CUDA in one process; not flattening changes no arithmetic.
    "fp16": (["--fp16", "--fp16-no-flatten-grads", "--fp16-init-scale", "64"], ROUNDOFFS * 2.0**-11),
    # fairseq's autocast is CUDA's (fp32 on the CPU); its GradScaler is replaced by the CPU's (amp_on_cpu).
    "amp": (["--amp", "--amp-batch-retries", "0", "--fp16-init-scale", "64"], 1e-4),
}
# fmt: on


def low_precision_flags(precision, experts):
    """``precision``'s flags, with every token routed to all ``experts`` (k = E) and a smooth activation (gelu):
    a step in which a rounding decides something discretely is not held to a few roundoffs. Top-k of fewer experts
    flips for a token whose scores nearly tie, and relu's derivative for a hidden unit near 0, when the rounding
    differs between one process and W workers (another batch shape through the CPU's low-precision kernels): the
    token's gradient then goes to another expert, or a whole term of a gradient sum comes or goes. With k = E and
    gelu the step is a smooth function of the rounding (the fp32 oracles test top-k routing and relu)."""
    return [*PRECISIONS[precision][0], "--moe-top-k", str(experts), "--activation-fn", "gelu"]


def cpu_shims():
    """fairseq 0.12 builds the zero norm it logs after an fp16 overflow with ``.cuda()``."""
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def master_weights(trainer):
    """The fp32 weights the optimizer steps, by parameter name (whole tensors: FSDP2's slices are
    gathered, a collective every worker joins)."""
    model = trainer.get_model()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    optimizer = trainer.optimizer
    stepped = getattr(optimizer, "fp32_params", None)
    if stepped is None:  # fully_sharded (MemoryEfficientFP16Optimizer) or fp32: the parameters themselves
        stepped = [p for p in chain(trainer.model.parameters(), trainer.criterion.parameters()) if p.requires_grad]
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in stepped]
    return {n: w.detach().float().clone() for n, w in zip(names, whole)}


def loss_scale(trainer):
    scaler = getattr(trainer.optimizer, "scaler", None)
    if scaler is None:
        return None
    return float(scaler.get_scale() if hasattr(scaler, "get_scale") else scaler.loss_scale)


def amp_on_cpu(trainer):
    """fairseq's AMPOptimizer builds torch.cuda.amp.GradScaler, which disables itself without CUDA: the
    real scaler on the CPU instead, with fairseq's initial scale."""
    if hasattr(trainer.optimizer, "_grad_scaler"):
        scale = trainer.cfg.common.fp16_init_scale
        trainer.optimizer._grad_scaler = torch.amp.GradScaler("cpu", init_scale=scale)


def logged_step(task, trainer, pairs):
    from fairseq.logging import metrics

    with metrics.aggregate(new_root=True) as agg:
        trainer.train_step([collate(task, pairs)])
    return {"loss": float(agg["loss"].avg), "gnorm": float(agg["gnorm"].avg)}


def run_precision_case(data_dir, world, rank, shares, flags, overflow_on_rank=None):
    """Build a trainer with ``flags`` on ``world`` workers (this one ``rank``), take one step on
    this worker's share of the batch, or two where ``overflow_on_rank`` is given: the first with an
    inf in that rank's first expert gradient (every worker should skip it), the second clean."""
    from fairseq_moe_ext.parallel import fully_sharded

    task, trainer = build_trainer(training_args(data_dir, world, flags))
    amp_on_cpu(trainer)
    start = sum(shares[:rank])
    pairs = sentence_pairs(sum(shares))[start : start + shares[rank]]
    result = {"before": master_weights(trainer), "scales": [loss_scale(trainer)]}
    if overflow_on_rank is not None:
        if rank == overflow_on_rank:
            inject_once_into_first_experts(trainer.get_model(), float("inf"))
        trainer.train_step([collate(task, pairs)])  # skipped: fairseq logs nothing of it
        result["after_overflow"] = master_weights(trainer)
        result["updates_after_overflow"] = trainer.get_num_updates()
        result["scales"].append(loss_scale(trainer))
    result.update(logged_step(task, trainer, pairs))
    result["after"] = master_weights(trainer)
    result["held"] = fully_sharded.held_bytes(trainer.get_model(), trainer.optimizer.optimizer)
    result["dtypes"] = sorted({str(p.dtype) for p in trainer.get_model().parameters()})
    result["expert_names"] = [n for n, p in trainer.get_model().named_parameters() if getattr(p, "expert", False)]
    return result


def assert_same_step(got, want, tolerance, what, ep_rank=0):
    """``got`` (a worker's whole weights; its experts are those of expert-parallel rank ``ep_rank``)
    took the same step as ``want`` (one process holding every expert, or another backend on the same
    worker): the loss and the gradient norm within ``tolerance`` of each other, and every tensor's update
    within ``tolerance`` of its largest element in the root mean square over its elements (a single element
    whose exact gradient sums to nearly 0 may carry more of the rounding; a wrong scale, a lost worker's
    share or a low-precision master weight moves all of them)."""
    import pytest

    assert got["loss"] == pytest.approx(want["loss"], rel=tolerance), f"{what}: loss {got['loss']} vs {want['loss']}"
    assert got["gnorm"] == pytest.approx(want["gnorm"], rel=tolerance), f"{what}: {got['gnorm']} vs {want['gnorm']}"
    assert got["after"].keys() == want["after"].keys()
    # A tensor whose gradient is zero in exact arithmetic (attention's key bias: softmax ignores a
    # constant) moves by rounding noise alone: its updates are compared against the model's largest.
    floor = max(float((want["after"][n] - want["before"][n]).abs().max()) for n in want["after"]) / 100
    assert floor > 0, f"{what}: the reference did not step"
    for name, after in got["after"].items():
        before, want_after = want["before"][name], want["after"][name]
        if before.shape != after.shape:  # experts: this worker's share of the one process's
            rows = after.shape[0]
            before, want_after = (t[ep_rank * rows : (ep_rank + 1) * rows] for t in (before, want_after))
        assert torch.equal(got["before"][name], before), f"{what}: {name} started elsewhere"
        update = want_after - before
        scale = max(float(update.abs().max()), floor)
        rms = float((after - before - update).double().pow(2).mean().sqrt())
        assert rms <= tolerance * scale, (
            f"{what}: {name} moved {rms / scale:.2e} of its scale off, over {tolerance:.2e}"
        )
