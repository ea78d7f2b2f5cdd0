"""Every place where this plugin reaches into fairseq internals, in one module.

Checked against fairseq 0.12.3 (ve-fairseq==0.12.3, the same sources as fairseq-fixed==0.12.3.1) and
torch 2.13. ``install()`` runs when fairseq imports the ``--user-dir`` package, which happens before
argument parsing and before distributed initialisation, in every worker and in every fairseq CLI.
``tests/test_fairseq_integration.py`` fails if any hooked function changes under us.

Hooks:
  1. checkpoint_utils.load_checkpoint_to_cpu: torch >= 2.6 unpickles with ``weights_only=True``;
     fairseq checkpoints hold a few plain Python types beyond tensors. We allow exactly those (see
     ``CHECKPOINT_SAFE_GLOBALS``) for the duration of fairseq's load, keep the check on, and turn
     torch's multi-line refusal into one line naming the offending type.
  2. distributed.utils._infer_torch_distributed_launch_init: under torchrun it computes
     ``rank % torch.cuda.device_count()`` (ZeroDivisionError on CPU). Without CUDA every worker
     uses device 0 (the CPU) and the default nccl backend becomes gloo.
  3. models.DistributedFairseqModel (called by the trainer): for models with expert parameters,
     check the backend, verify shared parameters agree across workers, keep experts out of torch
     DDP's broadcast and all-reduce (its documented ignore list; CPU modules get no device_ids),
     and wrap the result so expert gradients are scaled to match the single-process update.
  4. utils.clip_grad_norm_ (called by every fairseq optimizer): with expert parameters present the
     norm is the global one (distributed.global_grad_norm); fairseq's own leaves experts out.
"""

import argparse
import collections
import functools
import logging
import os
import pickle
import re

import torch

logger = logging.getLogger(__name__)

CHECKED_FAIRSEQ_VERSIONS = ("0.12.2", "0.12.3")

# What fairseq 0.12 stores in a checkpoint besides tensors and builtins, found by loading real
# checkpoints of translation and language-model runs (see tests/test_fairseq_integration.py).
CHECKPOINT_SAFE_GLOBALS = [argparse.Namespace, collections.OrderedDict, collections.defaultdict]

_installed = False


class UnsafeCheckpointError(RuntimeError):
    pass


def _refusal(path, error) -> UnsafeCheckpointError:
    match = re.search(r"GLOBAL ([\w.]+)", str(error))
    what = match.group(1) if match else str(error).splitlines()[0]
    return UnsafeCheckpointError(
        f"refusing to load {path}: it pickles {what}, which is not among the types fairseq checkpoints "
        f"store; if you trust the file, add the type to fairseq_moe_ext.fairseq_integration."
        f"CHECKPOINT_SAFE_GLOBALS"
    )


def _wrap_load_checkpoint_to_cpu(original):
    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        with torch.serialization.safe_globals(CHECKPOINT_SAFE_GLOBALS):
            try:
                return original(path, *args, **kwargs)
            except pickle.UnpicklingError as error:
                raise _refusal(path, error) from None

    return load_checkpoint_to_cpu


def _wrap_torchrun_init(original):
    @functools.wraps(original)
    def infer_torch_distributed_launch_init(cfg):
        if torch.cuda.device_count() > 0:
            return original(cfg)
        cfg.distributed_init_method = "env://"
        cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
        cfg.distributed_rank = int(os.environ["RANK"])
        cfg.device_id = 0  # infer_init_method calls torch.cuda.set_device for any id > 0
        cfg.distributed_no_spawn = True
        if cfg.distributed_backend == "nccl":
            logger.info("no CUDA device: using the gloo backend for torchrun workers")
            cfg.distributed_backend = "gloo"

    return infer_torch_distributed_launch_init


def _wrap_distributed_model(original):
    from . import distributed as moe_dist

    @functools.wraps(original)
    def distributed_fairseq_model(args, model, process_group, device):
        if not moe_dist.has_experts(model):
            return original(args, model, process_group, device)
        backend = args.ddp_backend
        if backend not in moe_dist.SUPPORTED_DDP_BACKENDS:
            raise moe_dist.unsupported_backend_error(backend)
        model = model.to(device)
        moe_dist.check_shared_parameters_agree(model, process_group)
        if backend in ("c10d", "pytorch_ddp"):
            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, moe_dist.expert_parameter_names(model)
            )
        if backend in ("c10d", "pytorch_ddp") and device.type == "cpu":
            from fairseq.distributed import ModuleProxyWrapper

            # fairseq passes device_ids=[device_id], which torch refuses for CPU modules.
            wrapped = ModuleProxyWrapper(
                torch.nn.parallel.DistributedDataParallel(
                    module=model,
                    broadcast_buffers=args.broadcast_buffers,
                    bucket_cap_mb=args.bucket_cap_mb,
                    process_group=process_group,
                    find_unused_parameters=args.find_unused_parameters,
                    gradient_as_bucket_view=args.gradient_as_bucket_view,
                )
            )
        else:
            wrapped = original(args, model, process_group, device)
        moe_dist.EXPERT_PARALLEL_TRAINING = True
        return moe_dist.ExpertParallelModel(wrapped, torch.distributed.get_world_size(process_group))

    return distributed_fairseq_model


def _wrap_clip_grad_norm(original):
    from . import distributed as moe_dist

    @functools.wraps(original)
    def clip_grad_norm_(params, max_norm, aggregate_norm_fn=None):
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if any(moe_dist.is_expert(p) for p in params):
            if aggregate_norm_fn is not None:
                raise moe_dist.unsupported_backend_error("fully_sharded")
            return moe_dist.clip_grad_norm_(params, max_norm)
        if moe_dist.EXPERT_PARALLEL_TRAINING and params:
            raise RuntimeError(
                "the optimizer's parameters lost the expert marker (--fp16 flattens gradients into one "
                "buffer), so expert gradients would be clipped per worker: add --fp16-no-flatten-grads"
            )
        return original(params, max_norm, aggregate_norm_fn)

    return clip_grad_norm_


def _patch(owner, name, wrapper):
    current = getattr(owner, name)
    if not getattr(current, "__wrapped_by_moe_ext__", False):
        patched = wrapper(current)
        patched.__wrapped_by_moe_ext__ = True
        setattr(owner, name, patched)


def install() -> None:
    """Install every hook once per process."""
    global _installed
    if _installed:
        return
    import fairseq
    import fairseq.distributed.utils as distributed_utils
    import fairseq.models
    from fairseq import checkpoint_utils, utils

    if not fairseq.__version__.startswith(CHECKED_FAIRSEQ_VERSIONS):
        raise ImportError(
            f"fairseq_moe_ext was checked against fairseq {', '.join(CHECKED_FAIRSEQ_VERSIONS)}, found "
            f"{fairseq.__version__}: install ve-fairseq==0.12.3 (see README)"
        )
    _patch(checkpoint_utils, "load_checkpoint_to_cpu", _wrap_load_checkpoint_to_cpu)
    _patch(distributed_utils, "_infer_torch_distributed_launch_init", _wrap_torchrun_init)
    _patch(fairseq.models, "DistributedFairseqModel", _wrap_distributed_model)
    _patch(utils, "clip_grad_norm_", _wrap_clip_grad_norm)
    _installed = True
