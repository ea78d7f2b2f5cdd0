"""Hooks 16 and 17, and the inference part of 8 and 11: generation, scoring and validation with
experts kept on their workers (``--moe-inference-experts``), and ``--eval-bleu`` in expert-parallel
training.

With experts on their workers every MoE call is collective, but fairseq's generators run as many
decoder steps as their own sentences need. ``moe/lockstep.py`` keeps workers together; here is
where fairseq meets it: the encoder's and decoder's ``forward`` announce themselves to it
(``attach_lockstep``), a worker whose batches ran out keeps mirroring the others' calls until all
are done (the progress-bar hook, which sees every inference CLI's batch loop end), and in training
each ``--eval-bleu`` generation is one lock-step session (the ``inference_step`` hook), finished
before fairseq gathers the validation statistics.
"""

import atexit
import contextlib
import functools
import logging
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import checkpoint as moe_ckpt
from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..moe import MoELayer
from ..moe.lockstep import LockStep
from ..options import INFERENCE_OPTIONS, moe_options
from ..options.inference import EXPERT_PLACEMENTS
from ..parallel import fully_sharded
from ..parallel.plan import plan_of
from ..parallel.process_state import STATE, LoadTarget, close_process_groups
from . import routing_stats
from .routing_stats import RoutingStatsRun
from .run_dtype import asked_dtype

logger = logging.getLogger(__name__)

MODES = EXPERT_PLACEMENTS


# fmt: off
@dataclass(frozen=True)
class ShardedInference:
    """This worker's place in an expert-sharded inference run (decided when the command line is parsed)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    # fairseq-generate divides by the time of this worker's batches when it ends (ZeroDivisionError
    # with none): a worker with an empty share stops once the others are done. (eval-lm divides by
    # its token count too, but its call_main ends with a barrier every worker must reach.)
    stop_when_empty: bool = False
    on_gpu: bool = False  # the model runs on CUDA device LOCAL_RANK (modulo the GPUs there are)
# fmt: on


def add_inference_experts_flag(parser) -> None:
    """Add every inference CLI record (``options/inference.py``) to ``parser``, once."""
    for o in INFERENCE_OPTIONS:
        if any(o.flag in a.option_strings for a in parser._actions):
            continue
        if o.type is bool:
            parser.add_argument(o.flag, action="store_true", help=o.help)
        elif o.choices:
            parser.add_argument(o.flag, choices=o.choices, default=o.default, help=o.help)
        else:
            parser.add_argument(o.flag, type=o.value_type, default=o.default, help=o.help)


@dataclass
class InferenceRun:
    """How an inference CLI with ``--path`` runs, one value written when its command line is parsed (the
    parse_args_and_arch hook, ``STATE.inference``) and read by the load_model_ensemble_and_task and
    progress_bar hooks."""

    sharded: Optional[ShardedInference] = None  # experts kept on their workers (None: every expert local)
    dtype: Optional[torch.dtype] = None  # what --fp16 / --bf16 asks for (None: no inference CLI)
    routing_stats: Optional[RoutingStatsRun] = None  # --moe-routing-stats
    lockstep: Optional[LockStep] = None  # the loaded model's, in an expert-sharded run (set by the load)


def current_run() -> InferenceRun:
    """The inference run the command line asked for; a default one where none was parsed (the hub)."""
    return STATE.inference if STATE.inference is not None else InferenceRun()


def decide_inference_run(args) -> None:
    """At parse time, in every CLI: how an inference run (a CLI with --path) runs, in ``STATE.inference``."""
    STATE.inference = InferenceRun(
        sharded=decide_sharded_inference(args),
        dtype=asked_dtype(args) if config_value(args, "path") else None,
        routing_stats=routing_stats.decide_routing_stats(args),
    )


def decide_sharded_inference(args) -> Optional[ShardedInference]:
    """Whether this inference run keeps experts sharded, and this worker's place in it."""
    mode = moe_options(args).moe_inference_experts
    path = config_value(args, "path")
    world = int(config_value(args, "distributed_world_size", 1) or 1)
    if not path or world <= 1 or "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) != world:
        return None  # one process, or torchrun and fairseq disagree (fairseq's own error, or N independent jobs)
    # fairseq-generate shards its batches by it but, never initialising distributed, leaves it 0 on
    # every torchrun worker (each would generate the first shard).
    args.distributed_rank = int(os.environ["RANK"])
    if mode == "local" or (mode == "auto" and saved_world_size(path.split(os.pathsep)[0]) != world):
        return None
    cpu = config_value(args, "cpu", False) or not torch.cuda.is_available()
    # On GPUs, fairseq's --distributed-backend (default nccl) as training honours it: "cuda:gloo"
    # runs two workers on one GPU, which NCCL refuses.
    backend = "gloo" if cpu else (config_value(args, "distributed_backend") or "nccl")
    return ShardedInference(
        args.distributed_rank,
        world,
        int(os.environ.get("LOCAL_RANK", "0")),
        backend,
        stop_when_empty=hasattr(args, "beam"),
        on_gpu=not cpu,
    )  # stop_when_empty: fairseq-generate


def saved_world_size(path: str) -> Optional[int]:
    """How many workers saved the set ``path`` names, by its manifest (None: no set of that name; the
    loader validates the set itself later)."""
    manifest = moe_ckpt.manifest_path(moe_ckpt.base_of(path))
    if not os.path.isfile(manifest):
        return None
    try:
        return int(moe_ckpt.read_manifest(manifest)["world_size"])
    except Exception:  # noqa: BLE001  (a damaged manifest: the loader says what is wrong with it)
        return None


def load_sharded(original, filenames, *args, **kwargs):
    """fairseq's load_model_ensemble_and_task for an expert-sharded run: each worker reads and builds
    only its experts; the model comes back in lock-step mode for the rest of the process."""
    run = current_run()
    sharded = run.sharded
    if len(filenames) != 1:
        raise MoEOptionError(
            f"--moe-inference-experts sharded generates with one model, got an ensemble of "
            f"{len(filenames)}: pass one --path, or add --moe-inference-experts local"
        )
    if not dist.is_initialized():  # fairseq-generate and -interactive never initialise distributed
        if sharded.on_gpu:
            # Workers beyond the GPU count share GPUs (only a backend other than NCCL allows that).
            torch.cuda.set_device(sharded.local_rank % torch.cuda.device_count())
        # The MoE layers' own groups get --moe-comm-timeout when the model is built.
        dist.init_process_group(sharded.backend, init_method="env://", rank=sharded.rank, world_size=sharded.world_size)
    # No inference CLI closes its process groups; left open, gloo's threads abort the interpreter at
    # exit now and then ("terminate called without an active exception", exit status -6).
    atexit.register(close_process_groups)
    STATE.load_targets.append(LoadTarget(sharded.rank, sharded.world_size, None, None))
    try:
        models, cfg, task = original(filenames, *args, **kwargs)
    finally:
        STATE.load_targets.pop()
    model = models[0]
    if not moe_layers(model):
        raise MoEOptionError(
            f"{filenames[0]} holds no MoE layers, so there are no experts to shard: drop "
            f"--moe-inference-experts sharded"
        )
    layout = plan_of(model).layout
    if layout.parallel_size != sharded.world_size:
        raise MoEOptionError(
            f"this model keeps its experts on {layout.parallel_size} of the {sharded.world_size} "
            f"workers (--moe-expert-parallel-size): add --moe-inference-experts local"
        )
    refuse_capacity_drops(moe_layers(model))
    run.lockstep = attach_lockstep(model)
    run.lockstep.active = True
    held = sorted({layer.num_local_experts for layer in moe_layers(model)})  # one per side's expert count
    spans = " or ".join(f"{sharded.rank * local}..{(sharded.rank + 1) * local - 1}" for local in held)
    logger.info(
        f"expert-sharded inference: worker {sharded.rank} of {sharded.world_size} holds experts {spans} of each "
        f"MoE layer, in lock-step"
    )
    return models, cfg, task


def refuse_capacity_drops(layers) -> None:
    """Expert-sharded inference routes every worker's batch in one MoE call: a capacity counts all of their
    tokens, so where it drops slots it drops others than one process generating the same batches drops. A
    token fraction (which replaces the factor when above 0) of 1 or more drops nothing: each expert gets at
    most one slot per token."""
    if any(layer.eval_capacity_token_fraction == 0 and layer.eval_capacity_factor != 0 for layer in layers):
        raise MoEOptionError(
            "expert-sharded inference needs dropless routing to match one process (a capacity "
            "depends on every worker's tokens): pass --model-overrides "
            "\"{'moe_eval_capacity_factor': 0}\", or add --moe-inference-experts local"
        )
    fractions = sorted(layer.eval_capacity_token_fraction for layer in layers if layer.eval_capacity_token_fraction > 0)
    if fractions and fractions[0] < 1:
        raise MoEOptionError(
            f"expert-sharded inference needs dropless routing to match one process (an evaluation capacity "
            f"of {fractions[0]:g} of the tokens counts every worker's tokens): pass --model-overrides "
            "\"{'moe_eval_capacity_token_fraction': 1.0}\", or add --moe-inference-experts local"
        )


def moe_layers(module):
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def unwrapped(model):
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def attach_lockstep(model) -> Optional[LockStep]:
    """The model's LockStep (made on first use): its encoder's and decoder's forward announce
    themselves to it. None when its MoE layers talk to no other worker."""
    model = unwrapped(model)
    if not hasattr(model, "moe_lockstep"):
        stacks = [getattr(model, side, None) for side in ("encoder", "decoder")]
        stacks = [stack for stack in stacks if isinstance(stack, torch.nn.Module) and moe_layers(stack)]
        group = moe_layers(stacks[0])[0].statistics_group if stacks else None
        lockstep = None if group is None else LockStep([moe_layers(stack) for stack in stacks], group)
        for index, stack in enumerate(stacks if lockstep else []):
            stack.forward = announced(stack.forward, lockstep, index)
        model.moe_lockstep = lockstep  # kept on the model it serves
    return model.moe_lockstep


def announced(forward, lockstep: LockStep, index: int):
    @functools.wraps(forward)
    def forward_in_lockstep(*args, **kwargs):
        lockstep.before(index)
        return forward(*args, **kwargs)

    return forward_in_lockstep


# ------------------------------------------------ 16. a worker whose batches ran out keeps answering


def wrap_progress_bar(original):
    @functools.wraps(original)
    def progress_bar(iterator, *args, **kwargs):
        run = current_run()
        if run.lockstep is not None or run.routing_stats is not None:
            iterator = FinishingIterator(iterator, run.lockstep, run.sharded, run.routing_stats)
        return original(iterator, *args, **kwargs)

    return progress_bar


class FinishingIterator:
    """The batches of ``iterator``; once they run out, mirror the other workers until theirs have too.
    With ``stats`` (--moe-routing-stats) each batch's sentence keys go to it first, and its file is
    written (every worker's counts summed) once every worker is done."""

    def __init__(self, iterator, lockstep: Optional[LockStep], sharded: Optional[ShardedInference], stats=None):
        self.iterator, self.lockstep, self.sharded, self.stats = iterator, lockstep, sharded, stats

    def __len__(self):
        return len(self.iterator)

    def __getattr__(self, name):  # n, epoch, ...: what progress bars read off fairseq's iterators
        return getattr(self.iterator, name)

    def __iter__(self):
        empty = True
        for sample in self.iterator:
            empty = empty and not (isinstance(sample, dict) and "net_input" in sample)
            if self.stats is not None:
                routing_stats.start_batch(self.stats, sample)
            yield sample
        if self.lockstep is not None:
            self.lockstep.finish()
        if self.stats is not None:
            routing_stats.finish(self.stats, None if self.lockstep is None else self.lockstep.group)
        if empty and self.sharded is not None and self.sharded.stop_when_empty:
            logger.info(
                f"worker {self.sharded.rank} of {self.sharded.world_size} had no batch (fewer batches "
                f"than workers): it joined the others' MoE calls and has nothing to report"
            )
            sys.exit(0)


# ------------------------------------------------ 17. --eval-bleu: one lock-step session per generation


def wrap_inference_step(original):
    @functools.wraps(original)
    def inference_step(self, generator, models, sample, *args, **kwargs):
        # --ddp-backend fully_sharded: the shared part gathered while generating (parallel/fully_sharded.py).
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(fully_sharded.gathered_for_inference(model))
            lockstep = attach_lockstep(models[0]) if len(models) == 1 else None
            if lockstep is None or lockstep.active:  # one process, or a sharded CLI (always in lock-step)
                return original(self, generator, models, sample, *args, **kwargs)
            with lockstep.session():
                return original(self, generator, models, sample, *args, **kwargs)

    return inference_step
