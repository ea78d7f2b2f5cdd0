"""The hooks into fairseq internals: pinned to the fairseq they were checked against, and each one
doing its job in isolation."""

import argparse
import fractions

import pytest
import torch

import fairseq_moe_ext  # noqa: F401  (installs the hooks)
from fairseq_moe_ext import fairseq_integration
from fairseq_moe_ext.parallel.plan import ParallelPlan
from fairseq_moe_ext.parallel.process_state import STATE

# sha256[:16] of the source of every hooked or relied-on function in fairseq 0.12.3 (and the one
# argparse method hooked, from Python 3.11, and torch 2.13's GradScaler.step, whose found-inf record
# hook 13 fills). If one of them changes, re-read it, re-check the hook in
# fairseq_integration/ (the HOOKS table names the module), then update here.
# fmt: off
CHECKED_SOURCES = {
    "argparse.ArgumentParser.error": "6e52beacb0a82831",
    "fairseq.checkpoint_utils.load_checkpoint": "08e4fa03a2ab86a9",
    "fairseq.checkpoint_utils.load_checkpoint_to_cpu": "96f7d33cde8e1582",
    "fairseq.checkpoint_utils.load_model_ensemble_and_task": "13d16e9ecb8407a3",
    "fairseq.checkpoint_utils.save_checkpoint": "61513534b9b33e6a",
    "fairseq.distributed.legacy_distributed_data_parallel.LegacyDistributedDataParallel.all_reduce_grads": "e7a3d3e3f057d59a",
    "fairseq.distributed.utils._infer_single_node_init": "91ff8af2460022da",
    "fairseq.distributed.utils._infer_torch_distributed_launch_init": "eb06fc81bbbbaa13",
    "fairseq.distributed.utils.infer_init_method": "340321c1d2a184da",
    "fairseq.logging.progress_bar.progress_bar": "ccff0ad64057ea6b",
    "fairseq.models.transformer.transformer_encoder.TransformerEncoderBase.forward_torchscript": "72b658fccdb27d52",
    "fairseq.models.DistributedFairseqModel": "caa68bcad9ada051",
    "fairseq.modules.transformer_layer.TransformerDecoderLayerBase.forward": "ef2f541835fa38e6",
    "fairseq.modules.transformer_layer.TransformerEncoderLayerBase.forward": "e2def0f25e8b4141",
    "fairseq.nan_detector.NanDetector._apply": "871bd4f62126be34",
    "fairseq.nan_detector.NanDetector.add_hooks": "f3c99c8965fe0df2",
    "fairseq.optim.amp_optimizer.AMPOptimizer.clip_grad_norm": "8b4f889d171babc0",
    "fairseq.optim.amp_optimizer.AMPOptimizer.step": "2b8a6f80fa6ca14b",
    "fairseq.sequence_generator.EnsembleModel.forward_decoder": "0c1b51961115031e",
    "fairseq.sequence_generator.EnsembleModel.forward_encoder": "35f62b6b2c1dfd24",
    "fairseq.tasks.fairseq_task.FairseqTask.inference_step": "23b553e9b2aafed7",
    "fairseq.options.parse_args_and_arch": "535ef04316810361",
    "fairseq.trainer.Trainer._build_optimizer": "a49af54c95d127e9",
    "fairseq.trainer.Trainer.always_call_state_dict_during_save_checkpoint": "3c7d32776378e123",
    "fairseq.trainer.Trainer.is_fsdp": "64a439f685eb23e9",
    "fairseq.distributed.fully_sharded_data_parallel.fsdp_enable_wrap": "958141f8efc35e73",
    "fairseq.optim.fairseq_optimizer.FairseqOptimizer.load_state_dict": "c898c7b2f01de389",
    "fairseq.optim.fairseq_optimizer.FairseqOptimizer.multiply_grads": "ca8817df0879babf",
    "fairseq.trainer.Trainer._log_oom": "63dc7121e2fe08ec",
    "fairseq.trainer.Trainer._prepare_sample": "f997ae54f7c2fc5b",
    "fairseq.trainer.Trainer.checkpoint_suffix": "c6fdaf06fdd0efbd",
    "fairseq.trainer.Trainer.load_checkpoint": "128800d64185aede",
    "fairseq.trainer.Trainer.save_checkpoint": "46b39d54a4f75cc8",
    "fairseq.trainer.Trainer.should_save_checkpoint_on_current_rank": "d0e8464defa2cdde",
    "fairseq.trainer.Trainer.state_dict": "926c314f7f5545b4",
    "fairseq.trainer.Trainer.train_step": "8cbf0406b1fe5093",
    "fairseq.utils.clip_grad_norm_": "0e9a45d266e19456",
    "torch.amp.grad_scaler.GradScaler.step": "cb246ec35e769acd",
    "fairseq_cli.generate._main": "ca3a4a7f2f3a7fc4",
    "fairseq_cli.interactive.main": "9d87c54cae78a8b9",
    "fairseq_cli.validate.main": "037ba2ed2cfbe54f",
    "fairseq_cli.eval_lm.main": "709ed456c97776e7",
    "fairseq.hub_utils.from_pretrained": "d88bb772ba0b3e03",
    "fairseq.hub_utils.GeneratorHubInterface.__init__": "901f65e93189c944",
}
# fmt: on


def test_every_hooked_fairseq_function_is_the_version_the_hooks_were_checked_against():
    found = fairseq_integration.source_fingerprints()
    changed = {name: sha for name, sha in found.items() if CHECKED_SOURCES.get(name) != sha}
    assert not changed, f"fairseq changed under these hooks, re-check them: {sorted(changed)}"
    assert found.keys() == CHECKED_SOURCES.keys()


def test_every_row_of_the_hook_table_is_installed_pinned_and_listed_in_the_docstring():
    for hook in fairseq_integration.HOOKS:
        installed = fairseq_integration.resolve_qualified(hook.target)
        function = installed.fget if isinstance(installed, property) else installed
        assert getattr(function, "__wrapped_by_moe_ext__", False), f"{hook.target} is not hooked"
        assert hook.target in CHECKED_SOURCES, f"{hook.target} has no pinned fingerprint"
        listed = hook.target.split(".", 1)[1] if hook.target.startswith("fairseq.") else hook.target
        assert f"{hook.number:3d}. {listed}: " in fairseq_integration.__doc__


def test_installing_twice_wraps_nothing_twice():
    from fairseq import checkpoint_utils

    before = checkpoint_utils.load_checkpoint_to_cpu
    fairseq_integration._installed = False
    fairseq_integration.install()
    assert checkpoint_utils.load_checkpoint_to_cpu is before


def test_torchrun_on_cpu_uses_gloo_and_device_zero(monkeypatch):
    from fairseq.distributed import utils as distributed_utils

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    cfg = argparse.Namespace(distributed_backend="nccl")
    distributed_utils._infer_torch_distributed_launch_init(cfg)
    assert (cfg.distributed_world_size, cfg.distributed_rank, cfg.device_id) == (4, 3, 0)
    assert cfg.distributed_backend == "gloo" and cfg.distributed_no_spawn and cfg.distributed_init_method == "env://"


def test_a_checkpoint_with_a_disallowed_type_is_refused_in_one_line(tmp_path):
    from fairseq import checkpoint_utils

    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "cfg": None, "extra": fractions.Fraction(1, 3)}, path)
    with pytest.raises(fairseq_integration.UnsafeCheckpointError) as error:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    message = str(error.value)
    assert "\n" not in message and "fractions.Fraction" in message and "refusing to load" in message


def test_the_gradient_norm_of_an_moe_model_counts_its_experts():
    from fairseq import utils

    shared, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    expert.expert = True
    shared.grad, expert.grad = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    norm = utils.clip_grad_norm_([shared, expert], max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)  # stock fairseq would report 3.0
    torch.testing.assert_close(shared.grad, torch.tensor([0.6, 0.0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(expert.grad, torch.tensor([0.0, 0.8]), rtol=1e-5, atol=1e-6)


def test_flattened_fp16_gradients_are_refused_in_multi_worker_training(monkeypatch):
    from fairseq import utils

    monkeypatch.setattr(STATE, "training_plan", ParallelPlan(2, 2, 0))  # experts train on two workers
    flat = torch.nn.Parameter(torch.zeros(4))
    flat.grad = torch.ones(4)
    with pytest.raises(RuntimeError, match="--fp16-no-flatten-grads"):
        utils.clip_grad_norm_([flat], max_norm=1.0)


@pytest.mark.parametrize("backend", ["slowmo"])
def test_backends_that_would_shard_or_average_experts_are_refused(backend):
    from fairseq import models

    layer = fairseq_moe_ext.moe.MoELayer(fairseq_moe_ext.moe.MoELayerConfig(4, 8, 2))
    args = argparse.Namespace(ddp_backend=backend)
    with pytest.raises(ValueError, match=f"--ddp-backend {backend} is not supported with MoE models.*legacy_ddp"):
        models.DistributedFairseqModel(args, layer, process_group=None, device=torch.device("cpu"))


def test_eval_bleu_counters_stored_as_numpy_arrays_load_with_weights_only(tmp_path):
    import numpy as np

    from fairseq_moe_ext.checkpoint import CHECKPOINT_SAFE_GLOBALS

    path = tmp_path / "bleu.pt"
    counts = np.array([12, 7, 3, 1], dtype=np.int64)
    torch.save({"metrics": {"_bleu_counts": counts, "ratio": np.float64(0.5)}}, path)
    with torch.serialization.safe_globals(CHECKPOINT_SAFE_GLOBALS):
        state = torch.load(path, weights_only=True)
    assert (state["metrics"]["_bleu_counts"] == counts).all() and state["metrics"]["ratio"] == 0.5


def test_amp_applies_each_gradient_unscaled_once_as_torch_gradscaler_intends():
    from fairseq.optim.amp_optimizer import AMPOptimizer
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {
            "common": {"fp16_init_scale": 128, "amp_scale_window": None, "min_loss_scale": 1e-4},
            "optimizer": {"_name": "sgd", "lr": [1.0], "momentum": 0.0, "weight_decay": 0.0},
        }
    )
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = AMPOptimizer.build_optimizer(cfg, [weight])
    # fairseq builds torch.cuda.amp.GradScaler, disabled without CUDA: the same scaler on the CPU.
    optimizer._grad_scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    optimizer.backward((weight * torch.tensor([1.0, 2.0])).sum())
    optimizer.clip_grad_norm(0.0)  # unscales, as Trainer.train_step does before the step
    optimizer.step()
    # Stock fairseq unscales a second time in step() and moves the weight by -grad/128.
    assert weight.tolist() == [-1.0, -2.0]
