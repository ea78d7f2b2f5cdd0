"""What the ``--moe-*`` flags ask of the process and of the run around the model, checked or applied before
anything is built: the expert-parallel size P, the ddp backend, the collectives' timeout and deterministic
kernels."""

import logging
import os

import torch

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..parallel.expert_grads import SUPPORTED_DDP_BACKENDS, unsupported_backend_error
from ..parallel.expert_groups import (
    default_expert_parallel_size,
    expert_world_size,
    set_comm_timeout,
    set_expert_parallel_size,
)
from ..parallel.fully_sharded import refused_options, zero_sharding_error
from .moe_config import moe_option, side_expert_counts, side_expert_flags

logger = logging.getLogger(__name__)


def expert_parallel_size(args, world: int, sides=("encoder", "decoder")) -> int:
    """P for ``world`` workers: --moe-expert-parallel-size, checked, or by default the largest P
    dividing the workers and the experts of each of ``sides`` (P = W wherever each E is a multiple of W)."""
    counts = side_expert_counts(args, sides)
    size = moe_option(args, "moe_expert_parallel_size")
    if size is None:
        return default_expert_parallel_size(world, *counts.values())
    flags = side_expert_flags(args, counts)
    check_expert_parallel_size(size, world, {flags[side]: count for side, count in counts.items()})
    return size


def check_expert_parallel_size(size: int, world: int, experts) -> None:
    """P must divide the ``world`` workers (W/P replica groups) and the experts (E/P per worker);
    ``experts``: a count, or {the flag and value that set it: count} for each side."""
    if isinstance(experts, int):
        experts = {f"--moe-expert-count {experts}": experts}
    choices = [str(d) for d in range(1, world + 1) if world % d == 0 and all(e % d == 0 for e in experts.values())]
    listed = choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"
    named = " and ".join(dict.fromkeys(experts))
    fix = f"use a P dividing both {world} and {named} ({listed})"
    if world % size:
        raise MoEOptionError(f"--moe-expert-parallel-size {size} does not divide the {world} workers: {fix}")
    for flag, count in experts.items():
        if count % size:
            raise MoEOptionError(f"--moe-expert-parallel-size {size} does not divide {flag}: {fix}")


# The options that act under --ddp-backend fully_sharded only, one row each: (option, the value that does
# nothing, what any other value does there). Another value under another backend would be ignored: refused.
# fmt: off
FULLY_SHARDED_ONLY = (
    ("moe_fully_sharded_experts", "whole", "shards each MoE layer's experts over the workers holding the same ones"),
    ("moe_fully_sharded_unit", "layer", "makes the whole shared part one FSDP2 unit"),
)
# fmt: on


def options_without_effect(args, backend) -> list:
    """One line per option of ``args`` (the model's) that ``backend`` would ignore (None: not known here)."""
    if backend is None or str(backend) == "fully_sharded":
        return []
    lines = []
    for name, inactive, does in FULLY_SHARDED_ONLY:
        value = config_value(args, name)
        if value is not None and str(value) != inactive:
            flag = "--" + name.replace("_", "-")
            lines.append(
                f"{flag} {value} {does} under --ddp-backend fully_sharded only, and this run has --ddp-backend "
                f"{backend}, which would ignore it: add --ddp-backend fully_sharded, or drop {flag}"
            )
    return lines


def check_ddp_backend(args) -> None:
    """fairseq builds fully_sharded models differently before any MoE code runs, so the backend is
    checked while the command line is parsed (the architecture functions see every flag)."""
    backend = config_value(args, "ddp_backend")
    if backend is not None and str(backend) not in SUPPORTED_DDP_BACKENDS:
        raise unsupported_backend_error(str(backend))
    if str(config_value(args, "zero_sharding")) == "os":
        raise zero_sharding_error()
    refused = refused_options(args) if str(backend) == "fully_sharded" else options_without_effect(args, backend)
    if refused:
        raise MoEOptionError(refused[0])


def apply_runtime_options(args, sides=("encoder", "decoder")) -> None:
    """Process-wide settings the MoE flags ask for; called when a model is built (with MoE layers in
    ``sides``), before any expert-parallel group exists."""
    set_comm_timeout(float(moe_option(args, "moe_comm_timeout")))
    world = expert_world_size()
    if world > 1:  # one process (or every expert local): P is 1 whatever the flag says
        set_expert_parallel_size(expert_parallel_size(args, world, sides))
    if moe_option(args, "moe_deterministic"):
        # cuBLAS picks reduction orders per workspace unless told otherwise; the variable must be
        # set before its first use, which is after model construction.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        logger.info(
            "--moe-deterministic: torch.use_deterministic_algorithms(True), "
            f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}"
        )
