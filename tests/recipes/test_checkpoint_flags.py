"""recipes/checkpoint_flags.py: the flags it prints for a checkpoint rebuild that checkpoint's model."""

import sys

import torch
from omegaconf import OmegaConf

from fairseq import tasks
from support.inputs.tiny_fairseq_models import tiny_model_flags, train_config
from support.launch.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "recipes"))
from checkpoint_flags import MADE_FOR, model_flags  # noqa: E402

# An MoE with every kind of option the weights were made for set away from its default.
# fmt: off
TRAINED_WITH = ("--moe-expert-count", "4", "--moe-router", "sigmoid", "--moe-top-k", "2",
                "--moe-shared-expert-count", "1", "--moe-shared-expert-ffn-dim", "12", "--moe-balance", "bias",
                "--moe-expert-ffn-dim", "24", "--activation-fn", "gelu", "--moe-eval-capacity-token-fraction", "0.5",
                "--encoder-moe-freq", "1", "--decoder-moe-freq", "2")
# fmt: on


def built(data, *flags):
    argv = tiny_model_flags(data, "translation", "moe_transformer_tiny", "--source-lang", "src", "--target-lang", "tgt")
    cfg = train_config([*argv, *flags])
    return cfg, tasks.setup_task(cfg.task).build_model(cfg.model)


def test_the_printed_flags_rebuild_the_checkpoints_model_parameter_for_parameter(parallel_data, tmp_path):
    cfg, trained = built(parallel_data, *TRAINED_WITH)
    path = tmp_path / "checkpoint_best.pt"  # what fairseq's Trainer.state_dict stores as "cfg"
    torch.save({"cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "model": {}}, path)
    flags = model_flags(str(path))
    rebuilt_cfg, rebuilt = built(parallel_data, *flags)
    shapes = {name: tuple(p.shape) for name, p in trained.state_dict().items()}
    assert {name: tuple(p.shape) for name, p in rebuilt.state_dict().items()} == shapes, " ".join(flags)
    for name in MADE_FOR:  # also the ones that change no shape: router, top-k, activation
        assert getattr(rebuilt_cfg.model, name, None) == getattr(cfg.model, name, None), name
    assert rebuilt_cfg.model.moe_eval_capacity_token_fraction == 0.5


def test_the_options_a_checkpoint_is_made_for_include_the_router_shared_experts_and_balance():
    assert {"moe_router", "moe_top_k", "moe_shared_expert_count", "moe_balance", "activation_fn"} <= set(MADE_FOR)


def test_the_gate_loss_combination_a_checkpoint_records_is_printed_for_fine_tuning(parallel_data, tmp_path):
    """NLLB-200 MoE summed its layers' gate losses (this project averages by default): import-fairseq-moe keeps
    the criterion's option in the set, and the fine-tuning flags repeat it."""
    cfg, _ = built(parallel_data)
    saved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    saved["criterion"] = {"_name": "moe_label_smoothed_cross_entropy", "moe_gate_loss_combine_method": "sum"}
    torch.save({"cfg": saved, "model": {}}, tmp_path / "checkpoint_best.pt")
    flags = model_flags(str(tmp_path / "checkpoint_best.pt"))
    assert flags[flags.index("--moe-gate-loss-combine-method") + 1] == "sum"
    saved["criterion"] = {"_name": "cross_entropy"}
    torch.save({"cfg": saved, "model": {}}, tmp_path / "checkpoint_best.pt")
    assert "--moe-gate-loss-combine-method" not in model_flags(str(tmp_path / "checkpoint_best.pt"))
