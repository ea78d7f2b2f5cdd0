"""The plugin's process-wide state, in one object.

fairseq calls our hooks separately (a trainer method here, a checkpoint function there) and passes
none of its arguments between them, so a few facts must outlive one call. They live here, each
field saying who writes it and who reads it. Four others are kept beside what they describe, on
purpose, and are the only ones:

* ``fairseq_integration.ORIGINALS``: fairseq's own objects, as ``install()`` found them before
  patching (the hook table's record, read by the fingerprint test).
* ``Trainer._moe_in_train_step`` (``fairseq_integration/training.py``): set on the trainer for the
  duration of its ``train_step``, because fairseq's --amp retry calls ``train_step`` from inside
  itself and only the outermost call may count the update.
* ``MoEFeedForward.padding_mask`` (``models/moe_layers.py``): the layer's padding mask, handed to
  its feed-forward just before the forward and cleared right after.
* ``checkpoint.foreign._WARNED_ABOUT``: the files already warned about (one warning per foreign
  manifest per process); ``checkpoint/`` sits below this module and cannot reach ``STATE``.
* ``model.parallel_plan`` (``parallel/plan.py``) and ``model.moe_lockstep``
  (``fairseq_integration/inference.py``): what a model was built with, and its lock-step in inference,
  kept on the model they describe.

Importing this module imports nothing of fairseq's.
"""

import atexit
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, List, MutableMapping, Optional

import torch.distributed as dist


# fmt: off
@dataclass(frozen=True)
class LoadTarget:
    """The worker a checkpoint is being loaded for, while fairseq's Trainer.load_checkpoint runs."""

    rank: int  # its rank in the expert-parallel group
    parallel_size: int  # P, that group's size (the rank files a set is read as)
    model: Any  # the unwrapped model being resumed (its parameter shapes judge the checkpoint); None
    # for an expert-sharded inference load, whose model is built after the load
    model_cfg: Any  # its cfg.model (the flags that decide which parameters it has)
    criterion_cfg: Any = None  # its cfg.criterion (the resume policy logs changed loss weights)
# fmt: on


class ProcessGroups:
    """The process groups the plugin made, kept for the process: torch's ``new_group`` is collective (every
    worker makes the same groups in the same order), so plans of one layout share them, and a re-initialised
    default group (a new job in the same process) gets new ones. Closed at exit once any was made: fairseq's
    CLIs never close theirs, and gloo's threads left open abort the interpreter at exit now and then
    ("terminate called without an active exception", exit status -6)."""

    def __init__(self, made: Optional[MutableMapping] = None):
        self.made = {} if made is None else made  # (kind, default group, ...) -> what was made
        self.closes_at_exit = False

    def expert_groups(self, layout, timeout_s: Optional[float], make: Callable):
        """``make(layout, timeout_s)``'s groups, made once per default group, timeout and P."""
        key = ("expert", id(dist.group.WORLD), timeout_s, layout.parallel_size)
        return self._once(key, lambda: make(layout, timeout_s))

    def io_wait_group(self, make: Callable):
        """``make()``'s group for waits on file work, made once per default group."""
        return self._once(("io_wait", id(dist.group.WORLD)), make)

    def _once(self, key, make):
        if key not in self.made:
            for stale in [k for k in self.made if k[0] == key[0] and k[1] != key[1]]:
                del self.made[stale]  # made for an earlier default group, destroyed with it
            if not self.closes_at_exit:
                atexit.register(close_process_groups)
                self.closes_at_exit = True
            self.made[key] = make()
        return self.made[key]


def close_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# fmt: off
@dataclass
class ModelLoad:
    """A model being loaded to run (generation, scoring, the hub), for the duration of fairseq's
    load_model_ensemble_and_task: what the model's build and the checkpoint reads inside it must know."""

    experts_dtype: Any  # the torch dtype experts are built in, on meta, to be filled from the checkpoint
    every_expert_local: bool  # built holding every expert (False: an expert-sharded run's own share)
    mappings: List[Any] = field(default_factory=list)  # (path, start, end) of each file mapping a read made,
    # whose pages are given back once read (checkpoint/mapped_pages.py)


@dataclass(frozen=True)
class TeacherLoad:
    """A distillation teacher being loaded (``criterions/teacher.py``), for the duration of fairseq's
    load_model_ensemble_and_task: the dtype it runs in, and its expert share when its experts are spread
    over the training workers."""

    dtype: Any  # the torch dtype the teacher is built in and runs in
    share: Optional[LoadTarget] = None  # this worker's experts of a sharded teacher (None: every expert local)
    parallel_size: int = 1  # P of a sharded teacher: the workers its experts are spread over


@dataclass
class PluginState:
    # Writer and reader: plan.ParallelPlan.groups and io_waits.io_wait_group (the groups made, per
    # default group).
    process_groups: ProcessGroups = field(default_factory=ProcessGroups)
    # Writer: the DistributedFairseqModel hook, once it wraps an MoE model whose experts train (not
    # --moe-freeze experts) for several workers: that model's ParallelPlan. Reader: the clip_grad_norm_
    # hook, which fairseq hands the parameters alone (the expert-parallel group of the norm; gradients
    # that lost the expert marker are refused). None: no expert trains on several workers.
    training_plan: Optional[Any] = None
    # Writer: the Trainer._prepare_sample hook (fairseq's dummy batch). Reader: MoEFeedForward.forward.
    dummy_batch: bool = False
    # Writer: the Trainer.load_checkpoint hook (pushed around fairseq's load, popped after).
    # Reader: the load_checkpoint_to_cpu hook, which reads the innermost target's share of a set.
    load_targets: List[LoadTarget] = field(default_factory=list)
    # Writer and reader: fairseq_integration.saving.is_expert_parallel_trainer (a per-trainer
    # cache: are its experts split over P > 1 workers, each shard saved in its own rank file?).
    expert_parallel_trainers: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    # Writer: the AMPOptimizer.clip_grad_norm hook (did the global gradient norm overflow?).
    # Reader: the AMPOptimizer.step hook of the same optimizer, which consumes it.
    amp_overflow: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    # Writer: the parse_args_and_arch hook, in every CLI (fairseq_integration/inference.InferenceRun: how an
    # inference CLI with --path runs: experts sharded, the dtype, --moe-routing-stats; its lock-step once
    # loaded). Readers: the load_model_ensemble_and_task and progress_bar hooks. None: no inference CLI.
    inference: Optional[Any] = None
    # Writer: the load_model_ensemble_and_task hook (a ModelLoad, around fairseq's load). Readers: the models'
    # build (models/moe_layers.py: experts on meta, in its dtype; the plan: every expert local) and the
    # load_checkpoint_to_cpu hook. None: a model built to train, or from flags.
    model_load: Optional[ModelLoad] = None
    # Writer: criterions/teacher.load_teacher (a TeacherLoad, around fairseq's load_model_ensemble_and_task).
    # Reader: the load_model_ensemble_and_task hook, which builds the teacher in its dtype with its share of the
    # experts, and keeps the student task's state as it was. None: no teacher is being loaded.
    teacher_load: Optional[TeacherLoad] = None
# fmt: on


STATE = PluginState()
