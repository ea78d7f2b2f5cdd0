"""What the ``--moe-*`` flags ask of the process and of the run around the model, checked or applied before
anything is built: the ddp backend and deterministic kernels (the expert-parallel size P and the collectives'
timeout are the model's ParallelPlan, ``parallel/plan.py``)."""

import logging
import os

import torch

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..options import moe_options
from ..parallel.expert_grads import SUPPORTED_DDP_BACKENDS, unsupported_backend_error
from ..parallel.fully_sharded import refused_options, zero_sharding_error

logger = logging.getLogger(__name__)


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


def apply_runtime_options(args) -> None:
    """Process-wide settings the MoE flags ask for; called when a model is built."""
    if moe_options(args).moe_deterministic:
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
