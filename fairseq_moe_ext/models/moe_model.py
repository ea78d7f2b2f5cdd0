"""What every MoE model does around fairseq's own ``build_model`` and ``forward``.

A model class lists :class:`MoEModelMixin` before its fairseq base and states only what is its own:
which stacks (sides) get MoE layers, and any refusal of its own once the expert-parallel world size
is known. The mixin checks the flags, builds fairseq's dense model, rebuilds every ``--moe-freq``-th
layer of each side with an MoE feed-forward block, and owns the loss cache that MoE layers write to
and MoE criterions read from.
"""

import logging
from typing import Sequence

import torch
from fairseq.models.transformer.transformer_config import TransformerConfig

from ..common.config_value import config_value
from ..moe import MoEAuxCache, MoELayer
from ..moe.freeze import freeze_parts
from ..options import moe_options
from ..parallel.plan import ParallelPlan
from ..parallel.process_state import STATE
from .moe_config import check_moe_args, check_moe_layers_placed
from .moe_layers import install_moe_layers
from .moe_runtime import apply_runtime_options

logger = logging.getLogger(__name__)

# Layer seeds: expert e of layer i draws its initial weights from (seed, i, e) alone.
ENCODER_SEED_OFFSET, DECODER_SEED_OFFSET = 0, 1000
SEED_OFFSETS = {"encoder": ENCODER_SEED_OFFSET, "decoder": DECODER_SEED_OFFSET}


def attach_moe_cache(model) -> MoEAuxCache:
    cache = MoEAuxCache(scoped=True)
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            module.cache = cache
            module.name = name
    return cache


def moe_layer_names(model):
    return [name for name, m in model.named_modules() if isinstance(m, MoELayer)]


def base_seed(args) -> int:
    seed = config_value(args, "seed")
    if seed is None:
        # Models registered with a dataclass (moe_transformer_lm, and any model under
        # fairseq-hydra-train) get only their own config section, which has no seed. fairseq seeds
        # torch with --seed / common.seed right before building the model, so read it back there;
        # falling back to a constant made every --seed start from the same experts.
        seed = torch.initial_seed()
    # No `or 1`: --seed 0 is a seed of its own, not an alias of --seed 1.
    return int(seed) * 100_003


def apply_freeze(model, args) -> None:
    """--moe-freeze: the named parts get no gradient (before fairseq builds the optimizer and the
    data-parallel wrapper from the parameters that want one); a frozen router's losses are logged only."""
    frozen = freeze_parts(model, moe_options(args).moe_freeze)
    if not frozen:
        return
    counts = ", ".join(f"{part} {count:,}" for part, count in frozen.items())
    logger.info(f"--moe-freeze {','.join(frozen)}: these parameters do not train (elements: {counts})")
    if "router" in frozen:
        model.moe_cache.router_losses_apply = False
        logger.info(
            "--moe-freeze router: the balance loss and z-loss are logged but not added to the loss: they act on "
            "the router's choice, which is frozen (their gradient would only push the token representations "
            "towards a router that cannot move)"
        )


class MoEModelMixin:
    """Goes before a fairseq transformer model class in its bases (``super()`` is that class)."""

    @classmethod
    def build_moe_model(cls, args, task, sides: Sequence[str], no_encoder_attn: bool = False):
        """fairseq's model for ``args``, with MoE layers in each of ``sides`` ("encoder", "decoder")."""
        check_moe_args(args)
        check_moe_layers_placed(args, sides)
        apply_runtime_options(args)
        # How the model is spread over its workers, decided once here (P resolved and checked against the
        # workers) and kept on the model for everything that later has it (parallel.plan.plan_of); its
        # groups handed to the layers built below: experts are sharded over the P-worker group, routing
        # statistics are the whole world's. A model loaded to run holds every expert unless the run keeps
        # them sharded.
        every_expert_local = STATE.model_load is not None and STATE.model_load.every_expert_local
        plan = ParallelPlan.for_model(args, sides, every_expert_local)
        group, statistics_group = plan.parallel_group, plan.statistics_group
        cls.check_expert_parallel_world(args, plan.world_size)
        model = super().build_model(args, task)
        cfg = TransformerConfig.from_namespace(args)
        seed = base_seed(args)
        for side in sides:
            install_moe_layers(
                getattr(model, side),
                cfg,
                args,
                side,
                seed + SEED_OFFSETS[side],
                group=group,
                statistics_group=statistics_group,
                no_encoder_attn=no_encoder_attn,
            )
        model.moe_cache = attach_moe_cache(model)
        apply_freeze(model, args)
        model.parallel_plan = plan
        return model

    @classmethod
    def check_expert_parallel_world(cls, args, world: int) -> None:
        """A model's own refusals once it is known how many workers train it together (``world``,
        1 when every expert is local); none by default."""

    def forward(self, *args, **kwargs):
        # The cache is scoped: MoE layers record their losses only inside the model's own forward, not
        # in the encoder/decoder steps fairseq's generators run directly (see moe/cache.py).
        with self.moe_cache.forward_pass():
            return super().forward(*args, **kwargs)
