"""Sparse upcycling, the fairseq side (the tensors: checkpoint/upcycle.py).

A dense checkpoint's architecture decides the MoE one (``transformer*`` -> ``moe_transformer``,
``transformer_lm*`` -> ``moe_transformer_lm``; the dense config's sizes are kept), its criterion the
MoE criterion, and the MoE flags given decide which layers become MoE. Two ways in:

* ``fairseq-moe upcycle DENSE OUT --moe-expert-count E ...`` writes the
  upcycled checkpoint (``upcycled_checkpoint``), which ``fairseq-train --restore-file`` continues
  (``--finetune-from-model`` too, for a single file) and ``fairseq-validate``/``-generate`` load;
* ``fairseq-train --arch moe_transformer* --moe-upcycle-from DENSE ...`` (``load_upcycled``) builds the
  model from its own command line and fills it from DENSE when the save dir has no checkpoint_last,
  as ``--finetune-from-model`` would: fresh optimizer, scheduler, meters and data iterator.
"""

import argparse
import copy
import logging

from fairseq.models import ARCH_MODEL_NAME_REGISTRY

from .. import checkpoint as moe_ckpt
from ..checkpoint.compat import check_resumable
from ..checkpoint.upcycle import UpcycleOptions, check_upcyclable, upcycle_state
from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..models.moe_config import MOE_OPTIONS, check_moe_args
from ..models.moe_transformer import NOT_SET_BY_ARCHITECTURE
from ..options import default, moe_options
from ..options.sides import sides_of
from ..parallel.plan import plan_of
from .restore_choice import FAIRSEQ_DEFAULT_RESTORE_FILE as RESTORE_DEFAULT

logger = logging.getLogger(__name__)

MOE_ARCHITECTURE_OF = {"transformer": "moe_transformer", "transformer_lm": "moe_transformer_lm"}
# fmt: off
MOE_CRITERION_OF = {"label_smoothed_cross_entropy": "moe_label_smoothed_cross_entropy",
                    "cross_entropy": "moe_cross_entropy"}
# fmt: on


def moe_architecture_of(model_cfg, path: str) -> str:
    arch = config_value(model_cfg, "arch") or config_value(model_cfg, "_name")
    family = ARCH_MODEL_NAME_REGISTRY.get(arch)
    if family not in MOE_ARCHITECTURE_OF:
        raise moe_ckpt.CheckpointSetError(
            f"{path} is a {arch!r} checkpoint (model {family!r}): upcycling converts fairseq's transformer and "
            f"transformer_lm architectures; train a dense --arch transformer* / transformer_lm* model first"
        )
    return MOE_ARCHITECTURE_OF[family]


def upcycled_cfg(dense_cfg, path: str, moe_flags: dict):
    """The dense checkpoint's config with the MoE architecture, flags and criterion."""
    if not isinstance(dense_cfg, dict) or dense_cfg.get("model") is None:
        raise moe_ckpt.CheckpointSetError(
            f"{path} has no model config (cfg.model; written by fairseq < 0.10?): load and save it with "
            f"fairseq 0.12 first, or train the dense model with it"
        )
    arch = moe_architecture_of(dense_cfg["model"], path)
    cfg = copy.copy(dense_cfg)
    options = {
        name: default(name)
        for name in MOE_OPTIONS
        if name not in NOT_SET_BY_ARCHITECTURE and (arch == "moe_transformer" or not name.startswith("encoder_"))
    }
    options.update(
        {k: v for k, v in moe_flags.items() if v is not None},
        moe_normalize_gate=True,
        moe_eval_capacity_factor=0.0,
        arch=arch,
        _name=arch,
    )
    try:
        check_moe_args(argparse.Namespace(**options))
    except ValueError as e:
        raise moe_ckpt.CheckpointSetError(str(e)) from None
    model = dense_cfg["model"]
    if isinstance(model, argparse.Namespace):
        cfg["model"] = argparse.Namespace(**{**vars(model), **options})
    else:
        cfg["model"] = {**model, **options}
    criterion = dense_cfg.get("criterion")
    name = config_value(criterion, "_name")
    if isinstance(criterion, dict) and name in MOE_CRITERION_OF:
        cfg["criterion"] = dict(criterion, _name=MOE_CRITERION_OF[name])
    elif name not in MOE_CRITERION_OF.values():
        raise moe_ckpt.CheckpointSetError(
            f"{path} was trained with --criterion {name}, which has no MoE counterpart here: upcycle checkpoints "
            f"trained with {' or '.join(MOE_CRITERION_OF)}"
        )
    return cfg


def upcycled_checkpoint(path: str, moe_flags: dict, noise: float, router_std: float, seed: int) -> dict:
    """The whole upcycled checkpoint (every expert, update 0) of the dense checkpoint ``path``."""
    dense = moe_ckpt.safe_load(dense_file(path))
    flags = moe_options(moe_flags, as_saved=True)  # the tool's flags: None where not given
    options = UpcycleOptions(flags.moe_expert_count, noise, router_std, seed, flags.moe_expert_ffn_dim)
    dense = check_upcyclable(dense, path, options)  # before the config: an MoE or non-FFN one is refused first
    cfg = upcycled_cfg(dense.get("cfg"), path, moe_flags)
    return upcycle_state(dense, path, options, cfg["model"], cfg)


def dense_file(path: str) -> str:
    """The file a dense checkpoint's name ``path`` refers to, resolved as --path, --restore-file and the
    checkpoint tool resolve names: a set's name or one of its rank files is an MoE checkpoint already."""
    resolved = moe_ckpt.resolve(path, fallback=False)
    if resolved is None:
        raise moe_ckpt.CheckpointSetError(f"no checkpoint named {path}: pass the dense checkpoint's file")
    if resolved.kind == "set":
        raise moe_ckpt.CheckpointSetError(
            f"{path} is already an MoE checkpoint (a set of per-rank files): upcycling starts from a dense fairseq "
            f"checkpoint; train on from this one with --restore-file, or reshard it"
        )
    return resolved.path


def check_upcycle_start(checkpoint_cfg) -> None:
    """--moe-upcycle-from is a first launch's start, as --finetune-from-model is: one of them only."""
    for given, other in (
        (checkpoint_cfg.restore_file != RESTORE_DEFAULT, "--restore-file"),
        (checkpoint_cfg.finetune_from_model, "--finetune-from-model"),
        (config_value(checkpoint_cfg, "continue_once"), "--continue-once"),
    ):
        if given:
            raise MoEOptionError(
                f"--moe-upcycle-from and {other} both name a checkpoint to start from: pass one of them"
            )


def load_upcycled(trainer, path: str) -> None:
    """``--moe-upcycle-from``: fill this worker's model (its share of the experts) from the dense
    checkpoint ``path``; the trainer keeps its fresh optimizer and starts at update 0."""
    model_cfg = trainer.cfg.model
    values = moe_options(model_cfg)
    if values.moe_router != "top":
        raise MoEOptionError(
            f"--moe-upcycle-from starts the router at zero (or small random weights), a --moe-router top router; "
            f"this run has --moe-router {values.moe_router}: use --moe-router top"
        )
    if not values.moe_normalize_gate:
        raise MoEOptionError(
            "--moe-upcycle-from needs --moe-normalize-gate: without it a token's k gates sum to less than 1 and the "
            "upcycled model does not start as the dense one; add --moe-normalize-gate"
        )
    for side in sides_of(model_cfg):
        if side.experts != model_cfg.moe_expert_count:
            raise MoEOptionError(
                f"--moe-upcycle-from copies each dense FFN into --moe-expert-count {model_cfg.moe_expert_count} "
                f"experts in every MoE layer, and this run has {side.experts_flag}: drop it, or upcycle "
                f"with --moe-expert-count {side.experts}"
            )
    options = UpcycleOptions(
        model_cfg.moe_expert_count,
        float(values.moe_upcycle_noise),
        float(values.moe_upcycle_router_std),
        int(trainer.cfg.common.seed),
        values.moe_expert_ffn_dim,
    )
    dense = moe_ckpt.check_is_checkpoint(moe_ckpt.safe_load(dense_file(path)), path)
    dense_model_cfg = config_value(dense.get("cfg"), "model")
    if moe_ckpt.is_dense(dense) and dense_model_cfg is not None:
        moe_architecture_of(dense_model_cfg, path)
    full = upcycle_state(dense, path, options, model_cfg, dense.get("cfg"))
    layout = plan_of(trainer._model).layout
    share = moe_ckpt.shard_state(full, layout.ep_rank, layout.parallel_size)
    check_resumable(path, share, trainer._model, layout.parallel_size, model_cfg)
    trainer.model.load_state_dict(share["model"], strict=True, model_cfg=model_cfg)
    logger.info(
        f"upcycled the dense checkpoint {path}: {len(share['moe']['expert_keys']) // 4} MoE layer(s) of "
        f"{options.experts} experts, each a copy of the dense FFN (noise {options.noise:g}, router std "
        f"{options.router_std:g}); fresh optimizer, training starts at update 0"
    )
