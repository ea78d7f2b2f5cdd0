"""``moe_transformer`` (translation) and ``moe_transformer_lm`` (language modelling).

Both build fairseq's own transformer first, so every transformer flag keeps its meaning, then
rebuild every ``--moe-freq``-th layer with an MoE feed-forward block (``MoEModelMixin``, in
``moe_model.py``). Here: the registered models, what each adds to the mixin, and their sizes.
"""

from dataclasses import dataclass

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel, transformer_iwslt_de_en, transformer_wmt_en_de
from fairseq.models.transformer import base_architecture as transformer_base_architecture
from fairseq.models.transformer_lm import (
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    base_lm_architecture,
    transformer_lm_gpt,
)
from fairseq.utils import safe_getattr

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..options import MODEL_OPTIONS, architecture_defaults, fill_defaults, moe_options
from .moe_config import MOE_OPTIONS, MoEConfig, MoEEncoderDecoderConfig, check_moe_args

# Re-exported: tests and user code import these from this module, where they used to live.
from .moe_model import (  # noqa: F401
    DECODER_SEED_OFFSET,
    ENCODER_SEED_OFFSET,
    MoEModelMixin,
    attach_moe_cache,
    base_seed,
    moe_layer_names,
)
from .moe_runtime import check_ddp_backend

# Read from the command line when a run starts (absent means no fallback): they shape no model, and
# the architectures have never written them into a model's args (their records' launch_only).
NOT_SET_BY_ARCHITECTURE = tuple(o.name for o in MODEL_OPTIONS if o.launch_only)


@register_model("moe_transformer")
class MoETransformerModel(MoEModelMixin, TransformerModel):
    """fairseq's ``transformer`` with MoE feed-forward blocks in every ``--moe-freq``-th layer."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        gen_parser_from_dataclass(parser, MoEEncoderDecoderConfig(), delete_default=True)

    @classmethod
    def build_model(cls, args, task):
        return cls.build_moe_model(args, task, sides=("encoder", "decoder"))

    @classmethod
    def check_expert_parallel_world(cls, args, world: int) -> None:
        # --eval-bleu generates in lock-step (fairseq_integration/inference.py), which matches one
        # process only when routing is dropless: a capacity would depend on the other workers' tokens.
        # The rule of sharded fairseq-generate (inference.refuse_capacity_drops): a token fraction above 0
        # replaces the factor, and drops nothing from 1 on.
        if not config_value(args, "eval_bleu") or world <= 1:
            return
        fraction = moe_options(args).moe_eval_capacity_token_fraction or 0
        if fraction == 0 and moe_options(args).moe_eval_capacity_factor:
            raise MoEOptionError(
                f"--eval-bleu on {world} workers needs dropless inference routing to score what one process "
                f"would generate: drop --moe-eval-capacity-factor (or set it to 0)"
            )
        if 0 < fraction < 1:
            raise MoEOptionError(
                f"--eval-bleu on {world} workers needs dropless inference routing to score what one process "
                f"would generate (an evaluation capacity of {fraction:g} of the tokens counts every worker's "
                f"tokens): drop --moe-eval-capacity-token-fraction, or set it to 1"
            )


def moe_architecture(args):
    """Fill in every --moe-* option not given with its dataclass default."""
    fill_defaults(args, [name for name in MOE_OPTIONS if name not in NOT_SET_BY_ARCHITECTURE])
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
    architecture_defaults(args, moe_expert_count=4)
    moe_transformer_base(args)


@dataclass
class MoETransformerLanguageModelConfig(TransformerLanguageModelConfig, MoEConfig):
    pass


@register_model("moe_transformer_lm", dataclass=MoETransformerLanguageModelConfig)
class MoETransformerLanguageModel(MoEModelMixin, TransformerLanguageModel):
    """fairseq's ``transformer_lm`` with MoE feed-forward blocks in every ``--moe-freq``-th layer."""

    @classmethod
    def build_model(cls, args, task):
        return cls.build_moe_model(args, task, sides=("decoder",), no_encoder_attn=True)


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
    architecture_defaults(args, moe_expert_count=4)
    moe_transformer_lm_base(args)
