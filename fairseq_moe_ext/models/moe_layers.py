"""fairseq transformer layers whose feed-forward block is an MoE layer.

The layer classes subclass fairseq's own, so attention, residuals, layer norms and every transformer
flag behave exactly as in the dense model. Only the FFN changes: ``fc1`` becomes the MoE block (router
and experts, each expert being ``fc1 -> activation -> activation dropout -> fc2`` with the model's
``--activation-fn`` and ``--activation-dropout``), ``fc2`` becomes the identity, and fairseq's
``dropout`` after the FFN is kept. Pad tokens are masked out of routing.
"""

import inspect
from typing import Optional

import torch
import torch.nn as nn
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from fairseq import utils

from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..moe import MoELayer, MoELayerConfig
from ..moe.placement import moe_layer_indices
from ..moe.torch_compat import check_backward_detection
from ..options import expert_count, layer_fields, moe_freq, moe_options
from ..parallel.process_state import STATE
from .moe_config import layer_config


class MoEFeedForward(MoELayer):
    """Stands in a fairseq layer's ``fc1`` slot; takes ``T x B x C`` input and the layer's
    ``B x T`` padding mask, which the layer hands over just before its forward."""

    padding_mask: Optional[torch.Tensor] = None
    token_shape = None  # (x.shape[:-1], batch_major) of the last forward

    def __init__(self, *args, batch_major: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        # --moe-batch-major-routing: tokens queue for capacity in B x T order, as the nllb branch's layers
        # transpose to before their MoE layer. Only which slots are dropped depends on it.
        self.batch_major = batch_major

    def forward(self, x):
        if not self.batch_major or x.dim() != 3:
            return self._forward_tokens(x)
        return self._forward_tokens(x.transpose(0, 1), batch_major=True).transpose(0, 1)

    def _forward_tokens(self, x, batch_major: bool = False):
        """``x``: T x B x C, or B x T x C when ``batch_major``."""
        # Which sentence of the batch each routed token belongs to, for a routing tally (--moe-routing-stats).
        self.token_shape = (tuple(x.shape[:-1]), batch_major)
        if STATE.dummy_batch:
            # fairseq's dummy batch (a worker whose data shard ran out repeats a batch with its loss
            # multiplied by 0): its tokens still travel through the all-to-all, so every worker
            # issues the same collectives, but count in no routing statistic, capacity or balance
            # loss: they are all treated as padding.
            return super().forward(x, torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device))
        mask = self.padding_mask
        if mask is not None:
            mask = mask[:, -x.shape[1 if batch_major else 0] :]  # cross-self-attention prepends source
            mask = mask if batch_major else mask.transpose(0, 1)
            if mask.shape != x.shape[:-1]:
                mask = None
        return super().forward(x, mask)


def moe_layer_config(args, model_dim: int, ffn_dim: int, side: Optional[str] = None) -> MoELayerConfig:
    """The one place fairseq args become an MoE layer's config (``moe/layer_config.py``): the fields the
    ``--moe-*`` flags set (``options.layer_fields``, from each option's record) and the dense layer's
    own flags; ``ffn_dim``: its ``--*-ffn-embed-dim``, the experts' hidden size unless --moe-expert-ffn-dim;
    ``side``: the experts are that side's count (--encoder/--decoder-moe-expert-count)."""
    activation_dropout = config_value(args, "activation_dropout") or config_value(args, "relu_dropout") or 0.0
    fields = layer_fields(args)
    if side is not None:
        fields["num_experts"] = expert_count(args, side)
    return layer_config(
        dict(fields, hidden_dim=fields["hidden_dim"] or ffn_dim),
        model_dim=model_dim,
        activation=utils.get_activation_fn(config_value(args, "activation_fn") or "relu"),
        activation_dropout=float(activation_dropout),
    )


class _MoEFFNMixin:
    """Build-time hooks shared by the encoder and decoder MoE layers."""

    def _init_moe(self, moe_ffn: MoEFeedForward):
        # fairseq's __init__ reads self.build_fc1/2 while constructing; stash the block first.
        object.__setattr__(self, "_pending_moe_ffn", moe_ffn)

    def build_fc1(self, input_dim, output_dim, q_noise, qn_block_size):
        ffn = self.__dict__.pop("_pending_moe_ffn")
        if q_noise:
            raise MoEOptionError("--quant-noise-pq is not supported on MoE layers: drop it, or use a dense --arch")
        return ffn

    def build_fc2(self, input_dim, output_dim, q_noise, qn_block_size):
        return nn.Identity()

    def _finish_moe(self):
        # The experts apply the activation and its dropout inside; the layer must not repeat them.
        self.activation_fn = _identity
        self.activation_dropout_module = nn.Identity()


def _identity(x):
    return x


class MoEEncoderLayer(_MoEFFNMixin, TransformerEncoderLayerBase):
    def __init__(self, cfg, moe_ffn: MoEFeedForward, return_fc=False):
        nn.Module.__init__(self)
        self._init_moe(moe_ffn)
        TransformerEncoderLayerBase.__init__(self, cfg, return_fc=return_fc)
        self._finish_moe()

    def forward(self, x, encoder_padding_mask, attn_mask=None):
        self.fc1.padding_mask = encoder_padding_mask
        try:
            return super().forward(x, encoder_padding_mask, attn_mask)
        finally:
            self.fc1.padding_mask = None


_DECODER_FORWARD = inspect.signature(TransformerDecoderLayerBase.forward)


class MoEDecoderLayer(_MoEFFNMixin, TransformerDecoderLayerBase):
    def __init__(self, cfg, moe_ffn: MoEFeedForward, no_encoder_attn=False):
        nn.Module.__init__(self)
        self._init_moe(moe_ffn)
        TransformerDecoderLayerBase.__init__(self, cfg, no_encoder_attn=no_encoder_attn)
        self._finish_moe()

    def forward(self, *args, **kwargs):
        bound = _DECODER_FORWARD.bind(self, *args, **kwargs)
        self.fc1.padding_mask = bound.arguments.get("self_attn_padding_mask")
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.fc1.padding_mask = None


def install_moe_layers(
    stack, cfg, args, side: str, layer_seed_base: int, *, group, statistics_group, no_encoder_attn=False
) -> int:
    """Replace every ``freq``-th layer of a built encoder/decoder ``stack`` by its MoE version, with
    its experts spread over the expert-parallel ``group`` (None: every expert local) and its routing
    statistics totalled over ``statistics_group`` (the world; None in one process).

    Returns how many layers were replaced. Layers are rebuilt (not converted) so the dense FFN
    weights never exist for them.
    """
    freq = moe_freq(args, side)
    ffn_dim = cfg.encoder.ffn_embed_dim if side == "encoder" else cfg.decoder.ffn_embed_dim
    model_dim = cfg.encoder.embed_dim if side == "encoder" else cfg.decoder.embed_dim
    config = moe_layer_config(args, model_dim, ffn_dim, side)  # every MoE layer of a side computes the same function
    replaced = 0
    for i in moe_layer_indices(len(stack.layers), freq):
        ffn = MoEFeedForward(
            config,
            group=group,
            statistics_group=statistics_group,
            seed=layer_seed_base + i,
            batch_major=bool(moe_options(args).moe_batch_major_routing),
            # A model built to be loaded (fairseq_integration/run_dtype.py): its experts on meta, in the dtype
            # they will run in, filled from the checkpoint when it is loaded.
            expert_device="meta" if STATE.model_load is not None else None,
            expert_dtype=None if STATE.model_load is None else STATE.model_load.experts_dtype,
        )
        if side == "encoder":
            layer = MoEEncoderLayer(cfg, ffn, return_fc=getattr(stack, "return_fc", False))
        else:
            layer = MoEDecoderLayer(cfg, ffn, no_encoder_attn=no_encoder_attn)
        stack.layers[i] = wrap_for_checkpointing(layer, cfg)
        replaced += 1
    return replaced


def wrap_for_checkpointing(layer: nn.Module, cfg) -> nn.Module:
    if not config_value(cfg, "checkpoint_activations"):
        return layer
    check_backward_detection()
    # fairseq's own checkpoint_wrapper runs the first forward under no_grad, which would cut the
    # balance loss off the graph; torch's non-reentrant checkpoint keeps it (see moe/cache.py).
    # Like fairseq's wrapper, replace forward on the instance so parameter names do not change.
    plain_forward = layer.forward

    def checkpointed_forward(*args, **kwargs):
        if not layer.training:
            return plain_forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(plain_forward, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed_forward
    return layer
