"""Hooks 20-22: ``--ddp-backend fully_sharded`` runs on torch's FSDP2 (``parallel/fully_sharded.py``), for
every model, instead of fairscale's FSDP (unmaintained, and it does not run on CPU).

fairseq takes fairscale-specific paths wherever ``Trainer.is_fsdp`` is true (it imports fairscale in
``__init__``, consolidates optimizer state through fairscale, aggregates the norm itself): that
property answers False, and hook 3 applies FSDP2 when fairseq wraps the model for data parallelism.
fairseq-train builds the model inside ``fsdp_enable_wrap`` (fairscale's wrapping context): that is
a no-op. Saves gather the sharded state one tensor at a time on every worker (hook 5), so every
worker must call ``Trainer.state_dict`` during a save; loads cut whole tensors into slices (the
model's pre-hook in parallel/fully_sharded.py, the optimizer's here)."""

import contextlib
import functools

import torch

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..common.torch_compat import foreach_mul_
from ..models.moe_runtime import options_without_effect
from ..parallel import expert_sharding, fully_sharded, sharded_training


def is_fully_sharded_backend(cfg) -> bool:
    return str(config_value(cfg, "ddp_backend")) == "fully_sharded"


def check_options(*nodes) -> None:
    """Raise the first refusal found in ``nodes`` (a Namespace, or a cfg's sections)."""
    refused = [line for node in nodes for line in fully_sharded.refused_options(node)]
    if refused:
        raise MoEOptionError(refused[0])


def optimizers(optimizer_cfg) -> dict:
    """The optimizer named in fairseq's cfg.optimizer, and those of a composite's parameter groups."""
    groups = config_value(optimizer_cfg, "groups") or {}
    inner = [config_value(config_value(g, "optimizer"), "_name") for g in groups.values()]
    return {"optimizer": config_value(optimizer_cfg, "_name"), "composite_optimizers": inner}


def wrap_is_fsdp(original_fget):
    def is_fsdp(self):
        if original_fget(self):  # fully_sharded: FSDP2 through hook 3, never fairscale's paths
            check_options(self.cfg.distributed_training, self.cfg.common, self.cfg.ema, optimizers(self.cfg.optimizer))
        else:  # fairseq-hydra-train's model options, which no command line brought to check_ddp_backend
            ignored = options_without_effect(self.cfg.model, config_value(self.cfg.distributed_training, "ddp_backend"))
            if ignored:
                raise MoEOptionError(ignored[0])
        return False

    return is_fsdp


def wrap_always_call_state_dict(original_fget):
    def always_call_state_dict_during_save_checkpoint(self):
        # The save's gathers are collectives: workers that write nothing still take part.
        return is_fully_sharded_backend(self.cfg.distributed_training) or original_fget(self)

    return always_call_state_dict_during_save_checkpoint


def wrap_fsdp_enable_wrap(original):
    @functools.wraps(original)
    @contextlib.contextmanager
    def fsdp_enable_wrap(cfg):
        yield  # models are built as they are; hook 3 shards them with FSDP2

    return fsdp_enable_wrap


def wrap_optimizer_load_state_dict(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict, optimizer_overrides=None):
        params = list(self.params)
        if any(fully_sharded.is_sharded(p) for p in params) and "state" in state_dict:
            state_dict = fully_sharded.sharded_optimizer_state(state_dict, params)
        return original(self, state_dict, optimizer_overrides)

    return load_state_dict


def wrap_optimizer_multiply_grads(original):
    @functools.wraps(original)
    def multiply_grads(self, c):
        params = list(self.params)
        if not any(fully_sharded.is_sharded(p) for p in params):
            return original(self, c)
        # torch's foreach refuses a list mixing FSDP2's slices (DTensors) with experts' plain tensors,
        # and a plain scalar tensor for DTensors: each worker scales its own slices, in place.
        grads = [fully_sharded.local_part(p.grad) for p in params if p.grad is not None]
        if grads:
            factor = c.to(grads[0].device) if torch.is_tensor(c) else c
            foreach_mul_(grads, factor)

    return multiply_grads


def shard_for_training(args, model, process_group, device):
    """Hook 3's branch for fully_sharded: the fairseq flags checked, then the model sharded by its plan."""
    check_options(args)  # a Namespace here: every flag in one place
    reshard = not config_value(args, "no_reshard_after_forward", False)
    return sharded_training.shard_for_training(model, process_group, device, reshard_after_forward=reshard)


def gather_full_state(trainer, state):
    """Trainer.state_dict's model and optimizer state with every shared tensor whole on rank 0 (one
    at a time, see fully_sharded.full_tensors) and left out on the other workers."""
    if not fully_sharded.is_fully_sharded(trainer._model):
        return state
    keep = expert_sharding.keeps_gathered  # rank 0, and the writer of each rank file for its experts
    state["model"] = fully_sharded.full_tensors(state["model"], keep)
    optimizer = state.get("last_optimizer_state")
    if isinstance(optimizer, dict) and "state" in optimizer:
        state["last_optimizer_state"] = fully_sharded.full_optimizer_state(optimizer, keep)
    return state
