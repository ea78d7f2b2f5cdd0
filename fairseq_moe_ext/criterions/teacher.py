"""The teacher of a distillation run (``--criterion moe_distillation --distill-teacher PATH``): found, checked
against the student's task and dictionaries, and loaded before training starts; held apart from the student.

``find_teacher`` reads what a teacher is without loading its weights: the name resolves as ``--path`` does (a
set by its plain name or a rank file, a single file: merged, imported, pruned), and the file holding its
shared state is memory-mapped for its cfg and its embeddings' shapes. Each problem is one line naming
``--distill-teacher`` (``MoEOptionError``): no checkpoint there, a damaged or incomplete set, a checkpoint of
another task, or of other dictionaries (the embeddings' sizes; the symbols too, where the dictionaries the
teacher was trained with are still on disk).

``load_teacher`` builds it through fairseq's ``load_model_ensemble_and_task`` with the student's task (the
plugin's load hook reads ``STATE.teacher_load``: the dtype it runs in, and this worker's share of its experts
when they are spread over the training workers, as in sharded generation), in eval mode, every parameter
without gradient. The criterion keeps it outside its module tree, so fairseq's Trainer never saves it, never
hands it to the optimizer or a data-parallel wrapper, and never casts it.
"""

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from fairseq.data import Dictionary
from fairseq.tasks import TASK_REGISTRY
from omegaconf import OmegaConf

from .. import checkpoint as moe_ckpt
from ..common.config_value import config_value
from ..common.refusal import MoEOptionError
from ..parallel.process_state import STATE, LoadTarget, TeacherLoad

logger = logging.getLogger(__name__)

FLAG = "--distill-teacher"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The embeddings whose rows are a dictionary's entries, and the dictionary of the student's task they must match.
EMBEDDINGS = (("encoder.embed_tokens.weight", "source"), ("decoder.embed_tokens.weight", "target"))


# fmt: off
@dataclass(frozen=True)
class TeacherCheckpoint:
    path: str  # as given to --distill-teacher
    resolved: str  # the set's manifest or the single file
    cfg: Any  # the teacher's saved cfg (model, task, ...)
    saved_world_size: int  # the workers that saved the set (1: a single file)
    expert_counts: Tuple[int, ...]  # E of its MoE layers, each once (empty: a dense teacher)
    rows: Dict[str, int]  # the rows of each embedding of EMBEDDINGS it holds
# fmt: on


def without_tool_fix(problem: str) -> str:
    """A checkpoint error's problem, without the fix it names for --path / --restore-file."""
    for what in ("the set", "it"):
        problem = problem.replace("; " + moe_ckpt.load_another(what), "")
    return problem.rstrip(".")


def find_teacher(path: Optional[str]) -> TeacherCheckpoint:
    """What ``path`` holds, checked as a teacher can be (its task and dictionaries: ``check_fits``)."""
    if not path:
        raise MoEOptionError(
            f"--criterion moe_distillation needs a teacher: add {FLAG} PATH (a checkpoint or set this plugin loads)"
        )
    try:
        resolved = moe_ckpt.resolve(path, fallback=False)
    except moe_ckpt.CheckpointError as error:
        raise MoEOptionError(
            f"{FLAG} {path}: {without_tool_fix(str(error))}: give {FLAG} a complete set or file"
        ) from None
    if resolved is None:
        raise MoEOptionError(
            f"{FLAG} {path}: no checkpoint or checkpoint set there: give the teacher's checkpoint (a set by its plain "
            f"name, e.g. ckpt/checkpoint_best.pt, or a file)"
        )
    manifest = moe_ckpt.read_manifest(resolved.path) if resolved.kind == "set" else None
    first = resolved.path
    if manifest is not None:
        entry = next(f for f in manifest["files"] if f["rank"] == 0)
        first = os.path.join(os.path.dirname(resolved.path), entry["name"])
    try:
        state = moe_ckpt.safe_load(first, mapped_load, verified=manifest is not None)
        moe_ckpt.check_is_checkpoint(state, first)
    except moe_ckpt.CheckpointError as error:
        raise MoEOptionError(f"{FLAG} {path}: {without_tool_fix(str(error))}: give {FLAG} another checkpoint") from None
    cfg = state.get("cfg")
    if cfg is None and state.get("args") is not None:
        from fairseq.dataclass.utils import convert_namespace_to_omegaconf

        cfg = convert_namespace_to_omegaconf(state["args"])
    if cfg is None:
        raise MoEOptionError(f"{FLAG} {path} holds no training config (cfg or args): give a checkpoint fairseq saved")
    if isinstance(cfg, dict):  # as fairseq's load_checkpoint_to_cpu makes it
        cfg = OmegaConf.create(cfg, flags={"allow_objects": True})
    if manifest is not None:
        counts = tuple(sorted({int(n) for n in manifest["num_experts"].values()}))
        world = int(manifest["world_size"])
    else:
        keys = (state.get("moe") or {}).get("expert_keys", [])
        counts, world = tuple(sorted({int(state["model"][k].shape[0]) for k in keys})), 1
    rows = {key: int(state["model"][key].shape[0]) for key, _ in EMBEDDINGS if key in state["model"]}
    return TeacherCheckpoint(path, resolved.path, cfg, world, counts, rows)


def mapped_load(path: str):
    """The file memory-mapped: its cfg and tensor shapes are read, its weights are not."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def task_name(task) -> str:
    return next((name for name, kind in TASK_REGISTRY.items() if kind is type(task)), type(task).__name__)


def check_fits(teacher: TeacherCheckpoint, task) -> None:
    """One line when the teacher was trained for another task, or with other dictionaries."""
    trained_for = str(config_value(config_value(teacher.cfg, "task"), "_name", None) or "")
    kind = TASK_REGISTRY.get(trained_for)
    # A task and its variants read the same inputs (translation_multi_simple_epoch_nllb is
    # translation_multi_simple_epoch with NLLB's data-source tags); a task this install does not know is left to
    # the dictionary check.
    if kind is not None and not (issubclass(type(task), kind) or issubclass(kind, type(task))):
        raise MoEOptionError(
            f"{FLAG} {teacher.path} was trained for --task {trained_for} and this run is --task {task_name(task)}: "
            f"distil from a teacher of this task (its inputs and outputs), or train the student with --task "
            f"{trained_for}"
        )
    for key, side in EMBEDDINGS:
        dictionary = getattr(task, f"{side}_dictionary", None)
        if key not in teacher.rows or dictionary is None:
            continue
        if teacher.rows[key] != len(dictionary):
            raise MoEOptionError(
                f"{FLAG} {teacher.path} has a {side} vocabulary of {teacher.rows[key]} entries and this run's {side} "
                f"dictionary has {len(dictionary)}: the teacher was trained with another dictionary; distil from a "
                f"teacher of these dictionaries, or binarise the data with the teacher's (fairseq-preprocess "
                f"--srcdict / --tgtdict)"
            )
        saved = saved_dictionary(teacher.cfg, side, task)
        if saved is not None and saved.symbols != dictionary.symbols[: len(saved)]:
            differ = next(i for i, (a, b) in enumerate(zip(saved.symbols, dictionary.symbols)) if a != b)
            raise MoEOptionError(
                f"{FLAG} {teacher.path} was trained with another {side} dictionary (entry {differ} is "
                f"{saved.symbols[differ]!r} there and {dictionary.symbols[differ]!r} here): distil from a teacher of "
                f"these dictionaries, or binarise the data with the teacher's (fairseq-preprocess --srcdict / "
                f"--tgtdict)"
            )


def saved_dictionary(cfg, side: str, student_task=None) -> Optional[Dictionary]:
    """The dictionary of ``side`` the teacher was trained with, where its data directory still holds it (its
    language as the teacher's cfg names it, else as the student's task inferred it from its own data)."""
    task = config_value(cfg, "task")
    data = str(config_value(task, "data", None) or "").split(os.pathsep)[0]
    lang = config_value(task, f"{side}_lang", None) or config_value(getattr(student_task, "cfg", None), f"{side}_lang")
    for name in ([f"dict.{lang}.txt"] if lang else []) + ["dict.txt"]:
        path = os.path.join(data, name)
        if data and os.path.isfile(path):
            return Dictionary.load(path)
    return None


def teacher_dtype(choice: str, fp16=False, bf16=False, memory_efficient_fp16=False, memory_efficient_bf16=False):
    """The dtype the teacher runs in: the run's precision for "student" (fairseq's order: --fp16 first)."""
    if str(choice) != "student":
        return DTYPES[str(choice)]
    if fp16 or memory_efficient_fp16:
        return torch.float16
    if bf16 or memory_efficient_bf16:
        return torch.bfloat16
    return torch.float32


def teacher_parallel_size(teacher: TeacherCheckpoint, choice: str, world: int) -> int:
    """How many workers the teacher's experts are spread over: the world (each holds E/W of every MoE layer) or
    1 (every worker holds every expert). ``auto``: spread where the set was saved by this many workers."""
    choice = str(choice)
    if world <= 1 or not teacher.expert_counts or choice == "local":
        return 1
    if choice == "auto" and teacher.saved_world_size != world:
        return 1
    uneven = [e for e in teacher.expert_counts if e % world]
    if uneven:
        raise MoEOptionError(
            f"--distill-teacher-experts sharded: the teacher's {uneven[0]} experts per MoE layer cannot be spread "
            f"evenly over {world} workers: use --distill-teacher-experts local, or a number of workers dividing "
            f"{uneven[0]}"
        )
    return world


def load_teacher(teacher: TeacherCheckpoint, task, dtype, parallel_size: int):
    """The teacher, built with ``task`` (the student's) in ``dtype``, in eval mode without gradients; with
    ``parallel_size`` > 1 this worker holds its share of the experts (every worker must load it, together)."""
    from fairseq import checkpoint_utils

    share, overrides = None, {}
    if parallel_size > 1:
        share = LoadTarget(dist.get_rank() % parallel_size, parallel_size, None, None)
        overrides = {"moe_expert_parallel_size": parallel_size}
    kept = dict(task.state_dict())  # fairseq merges the teacher's task state into the task it is given
    STATE.teacher_load = TeacherLoad(dtype, share, parallel_size)
    try:
        models, _, _ = checkpoint_utils.load_model_ensemble_and_task([teacher.path], arg_overrides=overrides, task=task)
    finally:
        STATE.teacher_load = None
        state = task.state_dict()
        state.clear()
        state.update(kept)
    model = models[0]
    model.eval()
    model.requires_grad_(False)
    placed = f"its experts spread over {parallel_size} workers" if parallel_size > 1 else "held whole by each worker"
    logger.info(
        f"distillation teacher {teacher.path}: {sum(p.numel() for p in model.parameters()):,} parameters on this "
        f"worker, {placed}, run in {str(dtype).replace('torch.', '')} without gradients, never saved with the student"
    )
    return model
