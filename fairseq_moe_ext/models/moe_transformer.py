"""``moe_transformer`` (translation) and ``moe_transformer_lm`` (language modelling).

Both build fairseq's own transformer first, so every transformer flag keeps its meaning, then
rebuild every ``--moe-freq``-th layer with an MoE feed-forward block. The model owns the loss cache
that MoE layers write to and MoE criterions read from.
"""

from dataclasses import dataclass

import torch
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer import base_architecture as transformer_base_architecture
from fairseq.models.transformer import transformer_iwslt_de_en, transformer_wmt_en_de
from fairseq.models.transformer.transformer_config import TransformerConfig
from fairseq.models.transformer_lm import (
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    base_lm_architecture,
    transformer_lm_gpt,
)
from fairseq.utils import safe_getattr

from ..distributed import expert_parallel_group
from ..moe import MoEAuxCache, MoELayer
from .moe_config import (
    MoEConfig,
    MoEEncoderDecoderConfig,
    apply_runtime_options,
    check_ddp_backend,
    check_moe_args,
    check_moe_layers_placed,
    check_moe_world_size,
)
from .moe_layers import install_moe_layers

# Layer seeds: expert e of layer i draws its initial weights from (seed, i, e) alone.
ENCODER_SEED_OFFSET, DECODER_SEED_OFFSET = 0, 1000


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
    seed = safe_getattr(args, "seed", None)
    if seed is None:
        # Models registered with a dataclass (moe_transformer_lm, and any model under
        # fairseq-hydra-train) get only their own config section, which has no seed. fairseq seeds
        # torch with --seed / common.seed right before building the model, so read it back there;
        # falling back to a constant made every --seed start from the same experts.
        seed = torch.initial_seed()
    # No `or 1`: --seed 0 is a seed of its own, not an alias of --seed 1.
    return int(seed) * 100_003


@register_model("moe_transformer")
class MoETransformerModel(TransformerModel):
    """fairseq's ``transformer`` with MoE feed-forward blocks in every ``--moe-freq``-th layer."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        gen_parser_from_dataclass(parser, MoEEncoderDecoderConfig(), delete_default=True)

    @classmethod
    def build_model(cls, args, task):
        check_moe_args(args)
        check_moe_layers_placed(args, ("encoder", "decoder"))
        apply_runtime_options(args)
        check_moe_world_size(args)  # after apply_runtime_options: it creates the expert group
        if safe_getattr(args, "eval_bleu", False) and expert_parallel_group() is not None:
            raise ValueError(
                "--eval-bleu generates during validation, where each worker runs a different number of "
                "decoder steps that expert-parallel MoE layers cannot follow: drop --eval-bleu and score "
                "checkpoints with fairseq-generate"
            )
        model = super().build_model(args, task)
        cfg = TransformerConfig.from_namespace(args)
        seed = base_seed(args)
        install_moe_layers(model.encoder, cfg, args, "encoder", seed + ENCODER_SEED_OFFSET)
        install_moe_layers(model.decoder, cfg, args, "decoder", seed + DECODER_SEED_OFFSET)
        model.moe_cache = attach_moe_cache(model)
        return model

    def forward(self, *args, **kwargs):
        with self.moe_cache.forward_pass():
            return super().forward(*args, **kwargs)


def moe_architecture(args):
    args.moe_expert_count = safe_getattr(args, "moe_expert_count", 8)
    args.moe_freq = safe_getattr(args, "moe_freq", 2)
    args.encoder_moe_freq = safe_getattr(args, "encoder_moe_freq", None)
    args.decoder_moe_freq = safe_getattr(args, "decoder_moe_freq", None)
    args.moe_top_k = safe_getattr(args, "moe_top_k", 2)
    args.moe_capacity_factor = safe_getattr(args, "moe_capacity_factor", 0.0)
    args.moe_eval_capacity_factor = safe_getattr(args, "moe_eval_capacity_factor", 0.0)
    args.moe_gate_noise = safe_getattr(args, "moe_gate_noise", 0.0)
    args.moe_gating_use_fp32 = safe_getattr(args, "moe_gating_use_fp32", False)
    args.moe_gating_no_fp32 = safe_getattr(args, "moe_gating_no_fp32", False)
    args.moe_router = safe_getattr(args, "moe_router", "top")
    args.moe_expert_ffn_dim = safe_getattr(args, "moe_expert_ffn_dim", None)
    args.moe_batch_prioritized_routing = safe_getattr(args, "moe_batch_prioritized_routing", False)
    args.moe_normalize_gate = safe_getattr(args, "moe_normalize_gate", False)
    args.moe_comm_timeout = safe_getattr(args, "moe_comm_timeout", 1800.0)
    args.moe_deterministic = safe_getattr(args, "moe_deterministic", False)
    # fairseq applies the architecture while it parses the command line: bad flags fail here,
    # before any data is read or any directory is created.
    check_moe_args(args)
    check_ddp_backend(args)


@register_model_architecture("moe_transformer", "moe_transformer")
def moe_transformer_base(args):
    moe_architecture(args)
    transformer_base_architecture(args)


@register_model_architecture("moe_transformer", "moe_transformer_iwslt_de_en")
def moe_transformer_iwslt_de_en(args):
    moe_architecture(args)
    transformer_iwslt_de_en(args)


@register_model_architecture("moe_transformer", "moe_transformer_wmt_en_de")
def moe_transformer_wmt_en_de(args):
    moe_architecture(args)
    transformer_wmt_en_de(args)


@register_model_architecture("moe_transformer", "moe_transformer_tiny")
def moe_transformer_tiny(args):
    """For tests and the CPU quickstart: 2+2 layers of width 64, 4 experts."""
    for side in ("encoder", "decoder"):
        setattr(args, f"{side}_embed_dim", safe_getattr(args, f"{side}_embed_dim", 64))
        setattr(args, f"{side}_ffn_embed_dim", safe_getattr(args, f"{side}_ffn_embed_dim", 128))
        setattr(args, f"{side}_layers", safe_getattr(args, f"{side}_layers", 2))
        setattr(args, f"{side}_attention_heads", safe_getattr(args, f"{side}_attention_heads", 4))
    args.moe_expert_count = safe_getattr(args, "moe_expert_count", 4)
    moe_transformer_base(args)


@dataclass
class MoETransformerLanguageModelConfig(TransformerLanguageModelConfig, MoEConfig):
    pass


@register_model("moe_transformer_lm", dataclass=MoETransformerLanguageModelConfig)
class MoETransformerLanguageModel(TransformerLanguageModel):
    """fairseq's ``transformer_lm`` with MoE feed-forward blocks in every ``--moe-freq``-th layer."""

    @classmethod
    def build_model(cls, args, task):
        check_moe_args(args)
        check_moe_layers_placed(args, ("decoder",))
        apply_runtime_options(args)
        check_moe_world_size(args)  # after apply_runtime_options: it creates the expert group
        model = super().build_model(args, task)
        cfg = TransformerConfig.from_namespace(args)
        install_moe_layers(model.decoder, cfg, args, "decoder", base_seed(args) + DECODER_SEED_OFFSET,
                           no_encoder_attn=True)
        model.moe_cache = attach_moe_cache(model)
        return model

    def forward(self, *args, **kwargs):
        with self.moe_cache.forward_pass():
            return super().forward(*args, **kwargs)


def moe_transformer_lm_base(args):
    # "moe_transformer_lm" itself is registered with the model; its defaults are the dataclass's.
    moe_architecture(args)
    base_lm_architecture(args)


@register_model_architecture("moe_transformer_lm", "moe_transformer_lm_gpt2_small")
def moe_transformer_lm_gpt2_small(args):
    """GPT-2 small's shape (12 layers, width 768, 12 heads, ffn 3072, gelu) with MoE every other layer."""
    moe_architecture(args)
    transformer_lm_gpt(args)


@register_model_architecture("moe_transformer_lm", "moe_transformer_lm_tiny")
def moe_transformer_lm_tiny(args):
    args.decoder_embed_dim = safe_getattr(args, "decoder_embed_dim", 64)
    args.decoder_ffn_embed_dim = safe_getattr(args, "decoder_ffn_embed_dim", 128)
    args.decoder_layers = safe_getattr(args, "decoder_layers", 2)
    args.decoder_attention_heads = safe_getattr(args, "decoder_attention_heads", 4)
    args.moe_expert_count = safe_getattr(args, "moe_expert_count", 4)
    moe_transformer_lm_base(args)
