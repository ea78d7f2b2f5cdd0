"""A model sharded for training under ``--ddp-backend fully_sharded``: the one route from a built model to
the wrapped one fairseq's Trainer holds, as the model's ``ParallelPlan`` says.

The route, all inside this tier: back to fp32 where fairseq's Trainer cast the model (the shards are the
master weights), the shared parameters checked equal on every worker (``expert_grads``), each MoE layer's
experts an FSDP2 unit over their replica group where the plan shards them (``expert_sharding``), then the
shared part one unit per layer or one for the whole model (``fully_sharded``), with the mixed-precision
policy of the dtype the model was cast to. fairseq's flags are checked by the hook that calls it
(``fairseq_integration/sharding.py``).
"""

import torch

from . import expert_grads, expert_sharding, fully_sharded
from .plan import plan_of


def shard_for_training(model, process_group, device, reshard_after_forward: bool = True):
    """FSDP2 over the data-parallel ``process_group`` as ``model``'s plan says: its experts over their replica
    group first where the plan shards them, then the shared part per unit (experts left out)."""
    low = fully_sharded.low_precision_dtype(model)
    # fairseq's Trainer cast the model to fp16/bf16 (it does so whenever is_fsdp is False): the shards
    # are the fp32 master weights, so it goes back to fp32 before sharding. Only the random
    # initialisation passed through the low precision; checkpoints load into the fp32 shards.
    model = model.to(device=device, dtype=torch.float32) if low is not None else model.to(device)
    if expert_grads.has_experts(model):
        expert_grads.check_shared_parameters_agree(model, process_group)
    policy = fully_sharded.mixed_precision_policy(low)
    # --moe-fully-sharded-experts sharded: each MoE layer's experts over their replica group, first (W > P).
    plan = plan_of(model)
    if plan.experts_sharded:
        expert_sharding.shard_experts(model, plan.replica_group, policy)
    # --moe-fully-sharded-unit (the model's plan; a dense model: one unit per layer).
    whole_model = plan.fsdp_unit == "model"
    sharded = fully_sharded.shard_model(
        model,
        process_group,
        units=[] if whole_model else None,
        mp_policy=policy,
        reshard_after_forward=reshard_after_forward,
    )
    return FullyShardedModel(sharded)


class FullyShardedModel(torch.nn.Module):
    """What fairseq's Trainer holds as its wrapped model under fully_sharded: the FSDP2 model as
    ``.module`` (fairseq's wrappers' convention), attributes, state_dict and load_state_dict passed to
    it. No ``all_reduce_grads``: FSDP2 reduce-scattered the shared gradients during backward."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """fairseq's Trainer runs every micro-batch of --update-freq but the last inside it: gradients
        accumulate whole, and only the last backward reduce-scatters."""
        return fully_sharded.gradient_sync_deferred(self.module)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)
