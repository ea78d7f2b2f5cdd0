"""The activation part of ``plan``: what one worker's training step keeps for backward, measured on
the ``meta`` device (shapes only) by running the model's forward and the loss on a worst-case batch
and adding the bytes of every tensor autograd saves (each storage once, parameters left out).

The batch: sentences as long as the model takes (``--max-source-positions``/``--max-target-positions``,
``--tokens-per-sample`` for a language model, at most ``--max-tokens``), as many as ``--max-tokens``
allows (``--batch-size`` sentences when no
``--max-tokens`` is given), on both sides; padding is assumed present (the masked path).

The MoE layers run a stand-in with the real layer's saved tensors for the worst case a worker can
receive (``moe/capacity.py``, ``moe/rows_received.py``): with dropless routing (capacity factor 0)
every slot of its expert-parallel group, ``k * n * P`` rows; with a capacity factor ``cf``, at most
``E/P * k * int(|cf| * ceil(n * W / E))`` rows and never more than ``k * n * P``. For those rows it
keeps what ``moe/expert_ffn.py`` keeps (the rows, the fc1 outputs, an activation-dropout mask) and the
gated combine (the expert outputs).

On top of what is saved, backward's largest temporaries: twice the largest saved tensor (typically the
log-probabilities over the vocabulary, whose gradient and the logits' gradient coexist with it).
``--amp`` is counted as fp32 activations (autocast's half copies are not modelled).
"""

import math
from contextlib import contextmanager
from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..common.config_value import config_value
from ..moe.layer import MoELayer
from .memory_plan import Layout, ModelShapes, Precision


class _DataDependentAnswers(TorchDispatchMode):
    """Meta tensors have no values: a Python ``if mask.any()`` gets True (padding present, the
    path that allocates more), ``.item()`` of a number 1."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


def worst_rows(layer: MoELayer, tokens: int, layout: Layout, capacity_factor=None) -> int:
    """The most rows this worker's experts can receive in one call, ``tokens`` being this worker's, under the
    training capacity factor (or ``capacity_factor``: evaluation's, for a teacher)."""
    k, p, e = layer.k, layout.parallel_size, layer.num_experts
    every_slot = k * tokens * p
    cf = layer.capacity_factor if capacity_factor is None else capacity_factor
    if cf == 0:
        return every_slot
    per_expert = k * int(abs(cf) * math.ceil(tokens * layout.world_size / e))
    return min(every_slot, (e // p) * per_expert)


def _standin(layer: MoELayer, rows_of: Callable[[int], int]):
    def forward(x, padding_mask=None):
        d = layer.model_dim
        flat = x.reshape(-1, d)
        n = flat.shape[0]
        router = layer.router.wg.weight
        logits = F.linear(flat.float(), router.float()) if layer.router.fp32 else F.linear(flat, router)
        gates = torch.softmax(logits, dim=-1, dtype=torch.float32)[:, :1].to(x.dtype)
        rows = rows_of(n)
        index = torch.zeros(rows, dtype=torch.long, device=x.device)
        dispatched = flat.index_select(0, index)
        w1, w2 = layer.experts.batched_fc1_w[0], layer.experts.batched_fc2_w[0]
        hidden = torch.relu(F.linear(dispatched, w1))
        if layer.experts.activation_dropout > 0:
            hidden = F.dropout(hidden, p=layer.experts.activation_dropout, training=True)
        out = F.linear(hidden, w2)
        y = flat.new_zeros(n, d).index_add(0, index, out * gates.index_select(0, index))
        y = y.view_as(x)
        if layer.shared_experts is not None:
            y = y + layer.shared_experts(x)
        return y

    return forward


@contextmanager
def _moe_standins(model, rows_for: Callable[[MoELayer, int], int]):
    """The MoE layers run ``_standin``; fairseq's sinusoidal positions read the batch's shape as a real
    tensor (on meta, ``seq_len > precomputed`` would have no value)."""
    import torch.onnx.operators as onnx_operators

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layer.forward = _standin(layer, lambda n, layer=layer: rows_for(layer, n))
    shape_as_tensor = onnx_operators.shape_as_tensor
    onnx_operators.shape_as_tensor = lambda x: torch.tensor(tuple(x.shape), dtype=torch.long)
    try:
        yield
    finally:
        onnx_operators.shape_as_tensor = shape_as_tensor
        for layer in layers:
            del layer.forward


def batch_shape(cfg, model) -> (int, int):
    """(sentences, tokens per sentence) of the worst-case batch of one worker."""
    max_tokens = config_value(cfg.dataset, "max_tokens")
    batch_size = config_value(cfg.dataset, "batch_size")
    names = ("max_source_positions", "max_target_positions", "tokens_per_sample")  # translation; language models
    limits = [config_value(cfg.task, name) for name in names]
    length = min(int(v) for v in limits if v) if any(limits) else 1024
    if max_tokens:
        length = min(length, int(max_tokens))
        return max(1, int(max_tokens) // length), length
    if batch_size:
        return int(batch_size), length
    raise ValueError(
        "plan needs --max-tokens (or --batch-size) to bound the activations: give the one you will train with"
    )


def saved_bytes(cfg, model, precision: Precision, rows_for) -> Dict[str, int]:
    """{"saved": bytes kept for backward, "largest": the largest of them} for one step's forward."""
    sentences, length = batch_shape(cfg, model)
    dtype = {"fp16": torch.float16, "memory_efficient_fp16": torch.float16}.get(precision.name)
    dtype = dtype or ({"bf16": torch.bfloat16, "memory_efficient_bf16": torch.bfloat16}.get(precision.name))
    if dtype is not None:
        model = model.to(dtype)
    model.train()
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    params |= {b.untyped_storage()._cdata for b in model.buffers()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in params:
            storages[storage._cdata] = storage.nbytes()
        return t

    tokens = torch.full((sentences, length), 4, dtype=torch.long, device="meta")
    lengths = torch.full((sentences,), length, dtype=torch.long, device="meta")
    saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with _DataDependentAnswers(), _moe_standins(model, rows_for), saving:
        if getattr(model, "encoder", None) is not None and hasattr(model, "decoder"):
            out = model(tokens, lengths, tokens)
        else:
            out = model(tokens, src_lengths=lengths)
        lprobs = model.get_normalized_probs(out, log_probs=True)
        loss = -lprobs.gather(-1, tokens.unsqueeze(-1)).sum() - lprobs.sum()
    del loss
    return {"saved": sum(storages.values()), "largest": max(storages.values(), default=0)}


class ActivationBound:
    """Called with a layout: the activation bytes of one worker (cached by the rows the layout gives)."""

    def __init__(self, cfg, model, shapes: ModelShapes, precision: Precision):
        self.cfg, self.model, self.precision = cfg, model, precision
        self.cache: Dict[tuple, int] = {}
        sentences, length = batch_shape(cfg, model)
        self.describe = (
            f"bound for {sentences} sentences x {length} tokens per side, worst-case rows per MoE layer, "
            f"saved tensors + 2x the largest"
        )

    def __call__(self, layout: Layout) -> int:
        key = (layout.parallel_size, layout.world_size)
        if key not in self.cache:
            counted = saved_bytes(self.cfg, self.model, self.precision, lambda layer, n: worst_rows(layer, n, layout))
            self.cache[key] = counted["saved"] + 2 * counted["largest"]
        return self.cache[key]


def activation_bytes(cfg, model, shapes: ModelShapes, precision: Precision) -> ActivationBound:
    return ActivationBound(cfg, model, shapes, precision)
