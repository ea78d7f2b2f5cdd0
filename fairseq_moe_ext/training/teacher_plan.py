"""What a distillation teacher adds to one worker, for ``plan`` (``--criterion moe_distillation --distill-teacher
PATH`` among fairseq-train's arguments): the teacher is built on the ``meta`` device from its checkpoint's cfg,
with the run's task, as the criterion builds it (``criterions/teacher.py``), and counted per worker:

* weights: its shared parameters whole and its experts spread as it will run (``--distill-teacher-experts``:
  E/W per MoE layer when spread over the W workers, all E otherwise), in the dtype it runs in
  (``--distill-teacher-dtype``; "student": the run's --fp16 / --bf16, else fp32), with its buffers; no
  gradient, no optimizer state, no master copy: it never trains;
* its forward: the most bytes its no-grad forward on the worst-case batch (``activation_bound.batch_shape``)
  keeps alive at once, measured on meta (every tensor an operation makes counted while a reference to it
  lives; parameters left out), its MoE layers receiving the most rows evaluation can give them (the
  evaluation capacity: dropless, every slot of the expert-parallel group), then the fp32 copy of its logits
  the loss softens;
* the targets the criterion keeps through the student's forward and backward: log q over the vocabulary
  (fp32), or with ``--distill-top-k K`` K values (fp32) and their K token ids (int64) per target token.

The sum is a bound: the teacher's forward runs before the student's, so its peak and the student's
activations never coexist.
"""

import weakref
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from ..common.config_value import config_value
from ..criterions import teacher as teachers
from ..moe.experts import is_expert
from ..moe.layer import MoELayer
from ..options import moe_options
from .activation_bound import _DataDependentAnswers, _moe_standins, batch_shape, worst_rows
from .memory_plan import Layout

CRITERION = "moe_distillation"


# fmt: off
@dataclass(frozen=True)
class TeacherCost:
    path: str
    dtype: torch.dtype
    parallel_size: int  # the workers its experts are spread over (1: each worker holds every expert)
    shared: int  # parameters, each once
    experts: int  # expert parameters, every expert
    weights: int  # bytes of its parameters and buffers on one worker
    forward: int  # bytes its forward keeps alive at once, and the fp32 copy of its logits
    targets: int  # bytes of the targets kept through the student's step

    @property
    def total(self) -> int:
        return self.weights + self.forward + self.targets

    def describe(self) -> str:
        spread = f"experts spread over {self.parallel_size} workers" if self.parallel_size > 1 else "held whole"
        experts = f" ({self.experts:,} in experts, {spread})" if self.experts else " (dense)"
        return (
            f"teacher {self.path}: {self.shared + self.experts:,} parameters{experts}, run in "
            f"{str(self.dtype).replace('torch.', '')}; per worker {gib(self.weights)} GiB of weights, "
            f"{gib(self.forward)} GiB for its forward, {gib(self.targets)} GiB of targets (column teacher)"
        )
# fmt: on


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


class LivePeak(_DataDependentAnswers):
    """The most bytes of tensors made by operations alive at once (each storage once; ``skip``: storages not
    to count, the parameters')."""

    def __init__(self, skip):
        super().__init__()
        self.skip, self.live, self.now, self.peak = set(skip), {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        key = t.untyped_storage()._cdata
        if key in self.skip:
            return
        if key not in self.live:
            self.live[key] = [t.untyped_storage().nbytes(), 0]
            self.now += self.live[key][0]
            self.peak = max(self.peak, self.now)
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]


def forward_peak(model, cfg, layout: Layout) -> int:
    """The bytes ``model``'s no-grad forward keeps alive at once on the worst-case batch of ``cfg``."""
    sentences, length = batch_shape(cfg, model)
    model.eval()
    skip = {p.untyped_storage()._cdata for p in model.parameters()}
    skip |= {b.untyped_storage()._cdata for b in model.buffers()}
    tokens = torch.full((sentences, length), 4, dtype=torch.long, device="meta")
    lengths = torch.full((sentences,), length, dtype=torch.long, device="meta")

    def rows(layer: MoELayer, n: int) -> int:
        return worst_rows(layer, n, layout, layer.eval_capacity_factor)

    tracker = LivePeak(skip)
    with torch.no_grad(), _moe_standins(model, rows), tracker:
        if getattr(model, "encoder", None) is not None and hasattr(model, "decoder"):
            out = model(tokens, lengths, tokens)
        else:
            out = model(tokens, src_lengths=lengths)
        logits = out[0]
        del out
    return tracker.peak + logits.numel() * 4  # and the fp32 copy the loss softens


def teacher_cost(cfg, task, world: int):
    """What the teacher of ``cfg`` (a fairseq-train cfg) adds to one of ``world`` workers; None without one."""
    criterion = config_value(cfg, "criterion")
    if str(config_value(criterion, "_name", "")) != CRITERION:
        return None
    values = moe_options(criterion)
    found = teachers.find_teacher(values.distill_teacher)
    common = config_value(cfg, "common")
    flags = ("fp16", "bf16", "memory_efficient_fp16", "memory_efficient_bf16")
    dtype = teachers.teacher_dtype(values.distill_teacher_dtype, *(config_value(common, f, False) for f in flags))
    parallel = teachers.teacher_parallel_size(found, values.distill_teacher_experts, world)
    with torch.device("meta"):
        model = task.build_model(found.cfg.model).to(dtype)
    shared = sum(p.numel() for p in model.parameters() if not is_expert(p))
    experts = sum(p.numel() for p in model.parameters() if is_expert(p))
    size = torch.finfo(dtype).bits // 8
    weights = (shared + experts // parallel) * size
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    forward = forward_peak(model, cfg, Layout(world, parallel) if parallel > 1 else Layout())
    sentences, length = batch_shape(cfg, model)
    top_k = values.distill_top_k
    per_token = top_k * (4 + 8) if top_k else len(task.target_dictionary) * 4
    return TeacherCost(found.path, dtype, parallel, shared, experts, weights, forward, sentences * length * per_token)
