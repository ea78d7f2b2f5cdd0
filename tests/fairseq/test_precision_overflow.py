"""Mixed precision and NaN/inf in expert-parallel training, through fairseq's own Trainer.

Two gloo workers each run a real ``Trainer.train_step``; an inf (or NaN) is injected into ONE
expert gradient on ONE worker, where no all-reduce would ever carry it to the other worker.
"""

import glob
import logging
import os

import pytest
import torch

from fairseq_moe_ext.moe.balance_bias import balance_biases
from support.inputs.gradient_overflow import BALANCE_BIAS, PRECISIONS, first_expert_parameter, inject_once, with_adam
from support.launch.dist_utils import run_on_workers
from support.launch.in_process_trainer import build_trainer, collate, sentence_pairs, training_args, write_dictionaries

pytestmark = pytest.mark.slow


def cpu_shims():
    """What fairseq 0.12's fp16 needs to run on a CPU-only torch: on an fp16 overflow its trainer
    builds the logged zero norm with torch.tensor(0.0).cuda()."""
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def loss_scale(optimizer):
    if hasattr(optimizer, "_grad_scaler"):
        return float(optimizer.scaler.get_scale())
    return float(optimizer.scaler.loss_scale)


def overflow_worker(rank, world, data_dir, flags):
    cpu_shims()
    # No clipping: an infinite norm clips every gradient to zero, and Adam's step on zeros would leave
    # the weights of a worker that wrongly stepped unchanged.
    argv = training_args(data_dir, world, ["--ddp-backend", "legacy_ddp", "--clip-norm", "0", *BALANCE_BIAS, *flags])
    task, trainer = build_trainer(with_adam(argv))
    if "--amp" in flags:
        # fairseq's AMPOptimizer builds torch.cuda.amp.GradScaler, which disables itself without CUDA:
        # the real scaler on the CPU, with fairseq's init scale.
        trainer.optimizer._grad_scaler = torch.amp.GradScaler("cpu", init_scale=trainer.cfg.common.fp16_init_scale)
    model = trainer.get_model()
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    scale_before = loss_scale(trainer.optimizer)
    if rank == 1:
        inject_once(first_expert_parameter(model), float("inf"))
    pairs = sentence_pairs(12)
    trainer.train_step([collate(task, pairs[6 * rank : 6 * rank + 6])])
    after = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {
        "changed": sorted(n for n in before if not torch.equal(before[n], after[n])),
        "params": after,
        "expert_names": [n for n, p in model.named_parameters() if getattr(p, "expert", False)],
        "scale_before": scale_before,
        "scale_after": loss_scale(trainer.optimizer),
        "num_updates": trainer.get_num_updates(),
        "biases": [bias.bias.clone() for bias in balance_biases(model)],
        "pending_loads": [bias.pending_load for bias in balance_biases(model)],
    }


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_an_inf_in_one_workers_expert_gradient_makes_every_worker_skip_the_step_alike(tmp_path, precision):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    results = run_on_workers(overflow_worker, 2, data_dir, PRECISIONS[precision])
    for rank, result in enumerate(results):
        assert result["changed"] == [], f"rank {rank} stepped on an overflow: {result['changed'][:3]}"
        assert result["num_updates"] == 0
        assert result["scale_after"] < result["scale_before"], f"rank {rank} did not back off its loss scale"
        # The biases start at zero; the load counted for the skipped step is dropped, not kept.
        assert len(result["biases"]) == 2 and all(not b.any() for b in result["biases"]), f"rank {rank}'s bias moved"
        assert result["pending_loads"] == [None, None], f"rank {rank} kept the load of a skipped step"
    assert results[0]["scale_after"] == results[1]["scale_after"]
    experts = set(results[0]["expert_names"])
    for name, value in results[0]["params"].items():
        if name not in experts:
            assert torch.equal(value, results[1]["params"][name]), f"shared {name} differs across ranks"


def fp16_optimizer_worker(rank, world, data_dir):
    task, trainer = build_trainer(training_args(data_dir, world, ["--ddp-backend", "legacy_ddp", "--fp16"]))
    optimizer = trainer.optimizer  # built here, before any batch
    experts = [p for p in trainer.get_model().parameters() if getattr(p, "expert", False)]
    return {
        "type": type(optimizer).__name__,
        "flat": optimizer.has_flat_params,
        "marked": sum(getattr(p, "expert", False) is True for p in optimizer.fp32_params),
        "experts": len(experts),
        "no_flatten": trainer.cfg.common.fp16_no_flatten_grads,
    }


def test_plain_fp16_on_two_workers_builds_the_per_parameter_optimizer_with_experts_marked(tmp_path):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    for result in run_on_workers(fp16_optimizer_worker, 2, data_dir):
        assert result["type"] == "FP16Optimizer" and not result["flat"] and result["no_flatten"]
        assert result["experts"] > 0 and result["marked"] == result["experts"]


def nan_crash_worker(rank, world, data_dir, save_dir):
    task, trainer = build_trainer(
        training_args(data_dir, world, ["--ddp-backend", "legacy_ddp", "--save-dir", save_dir])
    )
    if rank == 1:
        inject_once(first_expert_parameter(trainer.get_model()), float("nan"))
    pairs = sentence_pairs(12)
    try:
        trainer.train_step([collate(task, pairs[6 * rank : 6 * rank + 6])])
    except FloatingPointError as error:
        return f"FloatingPointError: {error}"
    return "no error"


def test_a_nan_crash_on_two_workers_writes_one_crash_file_per_worker(tmp_path):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    save_dir = tmp_path / "ck"
    save_dir.mkdir()  # fairseq-train makes it at start-up
    messages = run_on_workers(nan_crash_worker, 2, data_dir, str(save_dir))
    assert messages == ["FloatingPointError: gradients are Nan/Inf"] * 2
    names = sorted(os.path.basename(p) for p in glob.glob(str(save_dir / "crash*")))
    assert names == ["crash-rank-0-of-2.pt", "crash-rank-1-of-2.pt"]
    rank1 = torch.load(save_dir / "crash-rank-1-of-2.pt", weights_only=False)
    assert rank1["moe"]["rank"] == 1


# Where the NaN is put: (which parameter, which module's output it first shows up in).
# fmt: off
NAN_SOURCES = {
    # Expert 0's weights: the experts module's output (a tensor).
    "expert": (lambda n, p: getattr(p, "expert", False), lambda n: n.rsplit(".", 1)[0]),
    # The router's weights, which it reads with F.linear: its Routing output (a dataclass).
    "router": (lambda n, p: n.endswith("router.wg.weight"), lambda n: n[: -len(".wg.weight")]),
}
# fmt: on


@pytest.mark.parametrize("source", list(NAN_SOURCES))
def test_the_nan_detector_names_the_moe_module_where_a_nan_first_appears(tmp_path, caplog, source):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    (tmp_path / "ck").mkdir()
    task, trainer = build_trainer(training_args(data_dir, 1, ["--save-dir", str(tmp_path / "ck")]))
    chosen, module_of = NAN_SOURCES[source]
    name, parameter = next((n, p) for n, p in trainer.get_model().named_parameters() if chosen(n, p))
    with torch.no_grad():
        parameter[0].fill_(float("nan"))
    with caplog.at_level(logging.WARNING, logger="fairseq.nan_detector"):
        with pytest.raises(FloatingPointError):
            trainer.train_step([collate(task, sentence_pairs(12))])
    forward = [
        r.getMessage() for r in caplog.records if r.name == "fairseq.nan_detector" and "forward" in r.getMessage()
    ]
    assert forward, f"the NaN detector reported nothing: {[r.getMessage() for r in caplog.records]}"
    assert forward[0].startswith(f"NaN detected in output of {module_of(name)},"), forward[0]
    assert (tmp_path / "ck" / "crash.pt").exists()  # one process: fairseq's own name
