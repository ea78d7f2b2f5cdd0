"""What a worker holds after a training step through fairseq's Trainer, counted from the tensors
themselves (for tests/parallel/test_memory_plan.py, which compares it with ``plan``'s prediction):
the model's parameters and gradients, fairseq's fp32 master copies and their gradients
(FP16Optimizer), and the torch optimizer's per-parameter state, each by shared and expert.
Sharded tensors count their local slice; a tensor reached twice (a shared storage) counts once."""

import torch

from fairseq_moe_ext.moe.experts import is_expert

KINDS = ("params", "grads", "master", "optimizer")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def counted_bytes(trainer) -> dict:
    """{"shared": {kind: bytes}, "expert": {kind: bytes}} for KINDS."""
    counts = {side: dict.fromkeys(KINDS, 0) for side in ("shared", "expert")}
    seen = set()

    def add(side, kind, tensor):
        t = _local(tensor)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
        if t.numel() == 0 or key in seen:
            return
        seen.add(key)
        counts[side][kind] += t.numel() * t.element_size()

    side_of = lambda p: "expert" if is_expert(p) else "shared"
    for p in trainer.get_model().parameters():
        add(side_of(p), "params", p)
        if p.grad is not None:
            add(side_of(p), "grads", p.grad)
    wrapper = trainer.optimizer
    masters = getattr(wrapper, "fp32_params", None)
    if masters is not None:
        masters = list(masters.values()) if isinstance(masters, dict) else list(masters)
        for p32 in masters:
            add(side_of(p32), "master", p32)
            if p32.grad is not None:
                add(side_of(p32), "master", p32.grad)
    optimizer = wrapper.optimizer  # the torch optimizer inside every fairseq wrapper
    for group in optimizer.param_groups:
        for p in group["params"]:
            for value in optimizer.state.get(p, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    add(side_of(p), "optimizer", value)
    return counts


def cpu_precision_shims(trainer, flags):
    """What fairseq 0.12's fp16 and amp need on a CPU-only torch: its trainer builds a logged zero norm
    with ``.cuda()`` after an overflow, and --amp's torch.cuda GradScaler disables itself without CUDA."""
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    if "--amp" in flags:
        trainer.optimizer._grad_scaler = torch.amp.GradScaler("cpu", init_scale=trainer.cfg.common.fp16_init_scale)
