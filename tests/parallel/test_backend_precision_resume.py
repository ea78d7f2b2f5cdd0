"""A set written under one backend resumes under another in the same precision with its optimizer state:
``--ddp-backend fully_sharded`` steps fp32 shards with fairseq's MemoryEfficientFP16Optimizer, legacy_ddp
fp32 copies with FP16Optimizer, and fairseq refused every resume between the two ("Optimizer does not
match"); a fully_sharded ``--bf16`` / ``--fp16`` set did not even resume under fully_sharded (fairseq's
loading hack put the whole saved state back over each worker's slices, and Adam's first step failed).

Two gloo workers train two updates through fairseq's Trainer on the toy corpus and save a set with
fairseq's own ``save_checkpoint`` (the plugin's set writer), once per backend and precision; each set is
then resumed with fairseq's ``load_checkpoint``, as fairseq-train does, under each backend in the same
precision. Per pair (writer -> reader): every optimizer state tensor the reader holds (NAG's momentum,
whole) is bitwise the one the set saved for that parameter, and the fp16 loss scale is the saved one;
the reader's next update equals the writer's own resumed update (loss, gradient norm and every update
within the precision's tolerance); and a precision change is refused in one line naming --reset-optimizer.
"""

import shutil

import pytest
import torch

from support.launch.dist_utils import run_on_workers
from support.launch.mixed_precision_steps import NAG, master_weights
from support.launch.multiworker_cli_runs import moe_args

pytestmark = pytest.mark.slow

WORLD = 2
BACKENDS = ("fully_sharded", "legacy_ddp")
# The precision's flags, and how close the third update taken by the two backends from the same set agrees,
# relative to the largest update of a tensor (measured: 4.2% in bf16, 1.6% in fp16; legacy_ddp all-reduces
# low-precision gradients where fully_sharded reduce-scatters fp32 ones). A state not carried over moves a
# tensor by about its whole update (NAG's momentum is as large as a gradient by then).
# fmt: off
PRECISIONS = {
    "bf16": (["--bf16"], 0.1),
    "fp16": (["--fp16", "--fp16-init-scale", "64"], 0.04),
}
# fmt: on
UPDATES = 2


def argv(data, save_dir, backend, precision):
    flags = ["--ddp-backend", backend, "--no-epoch-checkpoints", *NAG, *PRECISIONS[precision][0]]
    return [*moe_args(data, save_dir, 100, *flags), "--distributed-world-size", str(WORLD)]


def trainer_for(argv_):
    from support.launch.in_process_trainer import build_trainer

    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # fairseq's logged zero norm after an fp16 overflow
    return build_trainer(argv_)[1]


def write_sets_worker(rank, world, data, root):
    from fairseq import checkpoint_utils

    for precision in PRECISIONS:
        for backend in BACKENDS:
            trainer = trainer_for(argv(data, f"{root}/{precision}-{backend}", backend, precision))
            epoch_itr = trainer.get_train_iterator(epoch=1)
            batches = epoch_itr.next_epoch_itr(shuffle=False)
            for _ in range(UPDATES):
                trainer.train_step([next(batches)])
            checkpoint_utils.save_checkpoint(trainer.cfg.checkpoint, trainer, epoch_itr, None)
    return None


def whole(value):
    """A state entry as saved: a DTensor gathered, a tensor copied, a plain value (fairseq Adam's step) kept."""
    value = value.full_tensor() if hasattr(value, "full_tensor") else value
    return value.clone() if torch.is_tensor(value) else value


def same(a, b) -> bool:
    return torch.equal(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else type(a) is type(b) and a == b


def held_optimizer_state(trainer):
    """The state of the torch optimizer that steps, by parameter name: whole tensors (FSDP2's slices
    gathered, a collective every worker joins), and the position of each parameter in the saved state."""
    model = trainer.get_model()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    fairseq_optimizer = trainer.optimizer
    inner = getattr(fairseq_optimizer, "fp32_optimizer", None) or fairseq_optimizer.wrapped_optimizer
    held = {}
    for name, p in zip(names, inner.params):
        state = inner.optimizer.state.get(p, {})
        held[name] = {k: whole(v) for k, v in state.items()}
    return held, names


def saved_optimizer_state(trainer, names):
    """What the set saved for this worker's parameters (the shared state and its experts' share)."""
    from fairseq_moe_ext.checkpoint import resolve
    from fairseq_moe_ext.checkpoint.share import load_share
    from fairseq_moe_ext.parallel.plan import plan_of

    layout = plan_of(trainer.get_model()).layout
    manifest = resolve(f"{trainer.cfg.checkpoint.save_dir}/checkpoint_last.pt", fallback=False).path
    share = load_share(manifest, layout.ep_rank, layout.parallel_size, lambda f: torch.load(f, weights_only=False))
    optimizer = share["last_optimizer_state"]
    return {name: optimizer["state"].get(i, {}) for i, name in enumerate(names)}, optimizer.get("loss_scale")


def resume_worker(rank, world, data, root, pairs):
    from fairseq.logging import metrics

    from fairseq import checkpoint_utils

    results = {}
    for precision, writer, reader in pairs:
        trainer = trainer_for(argv(data, f"{root}/{precision}-{writer}-to-{reader}", reader, precision))
        _, epoch_itr = checkpoint_utils.load_checkpoint(trainer.cfg.checkpoint, trainer)
        held, names = held_optimizer_state(trainer)
        saved, saved_scale = saved_optimizer_state(trainer, names)
        scaler = getattr(trainer.optimizer, "scaler", None)
        result = {"held": held, "saved": saved, "saved_scale": saved_scale, "num_updates": trainer.get_num_updates()}
        result["scale"] = None if scaler is None else float(scaler.loss_scale)
        result["optimizer"] = type(trainer.optimizer).__name__
        result["before"] = master_weights(trainer)
        with metrics.aggregate(new_root=True) as agg:
            trainer.train_step([next(epoch_itr.next_epoch_itr(shuffle=False))])
        result.update(loss=float(agg["loss"].avg), gnorm=float(agg["gnorm"].avg), after=master_weights(trainer))
        results[(precision, writer, reader)] = result
    return results


@pytest.fixture(scope="module")
def resumed(parallel_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("backend_resume")
    run_on_workers(write_sets_worker, WORLD, str(parallel_data), str(root))
    pairs = [(precision, w, r) for precision in PRECISIONS for w in BACKENDS for r in BACKENDS]
    for precision, writer, reader in pairs:
        shutil.copytree(root / f"{precision}-{writer}", root / f"{precision}-{writer}-to-{reader}")
    return {"root": root, "by_rank": run_on_workers(resume_worker, WORLD, str(parallel_data), str(root), pairs)}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("writer, reader", [("fully_sharded", "legacy_ddp"), ("legacy_ddp", "fully_sharded")])
def test_a_set_resumes_under_the_other_backend_with_its_optimizer_state(resumed, precision, writer, reader):
    tolerance = PRECISIONS[precision][1]
    for rank, by_pair in enumerate(resumed["by_rank"]):
        got, own = by_pair[(precision, writer, reader)], by_pair[(precision, writer, writer)]
        what = f"{precision} {writer} -> {reader}, rank {rank}"
        assert got["num_updates"] == UPDATES, what
        assert got["held"].keys() == got["saved"].keys()
        for name, saved in got["saved"].items():
            assert saved and got["held"][name].keys() == saved.keys(), f"{what}: {name} {list(got['held'][name])}"
            for key, value in saved.items():
                assert same(got["held"][name][key], value), f"{what}: {name}.{key} is not the saved one"
        assert got["scale"] == got["saved_scale"], f"{what}: loss scale {got['scale']} vs {got['saved_scale']}"
        # The next update: the writer's own resume's, in the precision's tolerance.
        assert got["loss"] == pytest.approx(own["loss"], rel=tolerance), what
        assert got["gnorm"] == pytest.approx(own["gnorm"], rel=tolerance), what
        floor = max(float((own["after"][n] - own["before"][n]).abs().max()) for n in own["after"]) / 100
        for name, after in got["after"].items():
            update, want = after - got["before"][name], own["after"][name] - own["before"][name]
            atol = tolerance * max(float(want.abs().max()), floor)
            torch.testing.assert_close(update, want, rtol=0, atol=atol, msg=f"{what}: {name}")


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_fully_sharded_mixed_precision_set_resumes_under_fully_sharded(resumed, precision):
    for rank, by_pair in enumerate(resumed["by_rank"]):
        got = by_pair[(precision, "fully_sharded", "fully_sharded")]
        assert got["optimizer"] == "MemoryEfficientFP16Optimizer"
        for name, saved in got["saved"].items():
            for key, value in saved.items():
                assert same(got["held"][name][key], value), f"{precision} rank {rank}: {name}.{key}"
        assert torch.isfinite(torch.tensor(got["loss"])) and got["gnorm"] > 0


def test_a_precision_change_on_resume_is_refused_in_one_line_naming_reset_optimizer(resumed, parallel_data, tmp_path):
    """A bf16 set resumed in fp32 (one process): fairseq's assertion traceback becomes one line."""
    from fairseq import checkpoint_utils
    from fairseq_moe_ext.common.refusal import MoEOptionError

    save_dir = tmp_path / "fp32"
    shutil.copytree(resumed["root"] / "bf16-fully_sharded", save_dir)
    args = moe_args(parallel_data, save_dir, 100, "--ddp-backend", "legacy_ddp", *NAG)
    trainer = trainer_for(args)
    with pytest.raises(MoEOptionError) as refused:
        checkpoint_utils.load_checkpoint(trainer.cfg.checkpoint, trainer)
    line = str(refused.value)
    assert "\n" not in line and "MemoryEfficientFP16Optimizer" in line and "FairseqNAG" in line, line
    assert "add --reset-optimizer to start the optimizer's moments" in line, line
