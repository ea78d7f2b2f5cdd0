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

Importing this module imports nothing of fairseq's.
"""

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


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


# fmt: off
@dataclass
class PluginState:
    # Writer: the models' build_model (--moe-comm-timeout, via expert_groups.set_comm_timeout).
    # Reader: expert_groups._new_expert_groups, when it creates the groups. None: torch's default.
    comm_timeout_s: Optional[float] = None
    # Writer: the models' build_model on several workers (--moe-expert-parallel-size, or its default
    # gcd(W, E), via expert_groups.set_expert_parallel_size). Reader: expert_groups.expert_layout.
    # None: P = W (every worker one shard, the layout before P could be chosen).
    expert_parallel_size: Optional[int] = None
    # Writer and reader: expert_groups._expert_groups (one expert_groups.ExpertGroups, this rank's
    # expert-parallel, replica and statistics groups, per default group, timeout and P).
    expert_groups: Dict[Any, Any] = field(default_factory=dict)
    # Writer and reader: expert_groups._new_expert_groups (whether close_process_groups is registered
    # to run at exit, once per process).
    closes_groups_at_exit: bool = False
    # Writer: expert_groups.all_experts_local() (entered by the load_model_ensemble_and_task hook, so
    # generation builds models holding every expert). Reader: expert_groups.expert_world_size.
    all_experts_local_depth: int = 0
    # Writer: the DistributedFairseqModel hook, once it wraps an MoE model whose experts train (not
    # --moe-freeze experts) for several workers.
    # Reader: the clip_grad_norm_ hook (gradients that lost the expert marker are refused then).
    expert_parallel_training: bool = False
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
    # Writer: the parse_args_and_arch hook (inference.decide_sharded_inference: --moe-inference-experts
    # on N torchrun workers). Reader: the load_model_ensemble_and_task hook. None: every expert local.
    sharded_inference: Optional[Any] = None
    # Writer: the parse_args_and_arch hook (run_dtype.record_inference_dtype: the torch dtype an inference CLI's
    # --fp16 / --bf16 asks for). Reader: the load_model_ensemble_and_task hook, which casts MoE models to it.
    # None: no inference CLI parsed (a hub load reads its own keyword overrides).
    inference_dtype: Optional[Any] = None
    # Writer: the load_model_ensemble_and_task hook (run_dtype.built_for_load, around fairseq's load). Reader:
    # models/moe_layers.install_moe_layers, which then builds experts on meta in this dtype, to be filled from the
    # checkpoint. None: experts are built and initialised (training, a model built from flags).
    experts_built_for_load: Optional[Any] = None
    # Writer: the load_checkpoint_to_cpu hook during such a load ((path, start, end) of each file mapping it made).
    # Reader: the same hook and the load_model_ensemble_and_task hook, which give their pages back
    # (checkpoint/mapped_pages.py) once read, and empty it.
    inference_mappings: List[Any] = field(default_factory=list)
    # Writer: inference.load_sharded (the sharded CLI's model, in lock-step for the whole process).
    # Reader: the progress_bar hook, whose iterator finishes the lock-step when its batches run out.
    inference_lockstep: Optional[Any] = None
    # Writer and reader: inference.attach_lockstep (a per-model cache: its moe.lockstep.LockStep, or
    # None when its MoE layers talk to no other worker).
    locksteps: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    # Writer: the parse_args_and_arch hook (routing_stats.decide_routing_stats: --moe-routing-stats).
    # Readers: the load_model_ensemble_and_task hook (attaches its tally) and the progress_bar hook.
    routing_stats: Optional[Any] = None
    # Writer and reader: io_waits.io_wait_group (the gloo group on which workers wait for another
    # worker's checkpoint file work, one per default group).
    io_wait_groups: Dict[Any, Any] = field(default_factory=dict)
# fmt: on


STATE = PluginState()
