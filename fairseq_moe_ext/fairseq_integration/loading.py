"""Hooks 1, 7 and 8: fairseq's checkpoint loads read per-rank sets, safely, at any world size; hook 7
also starts a --moe-upcycle-from run from its dense checkpoint."""

import functools
import logging
import os
import re

import torch
from omegaconf import open_dict

from .. import checkpoint as moe_ckpt
from ..checkpoint.compat import check_resumable
from ..checkpoint.mapped_pages import private_mappings, release_ranges
from ..checkpoint.share import load_share
from ..common.refusal import MoEOptionError
from ..options import moe_options
from ..parallel import expert_grads
from ..parallel.io_waits import broadcast_from_rank_0, io_wait_group
from ..parallel.plan import plan_of
from ..parallel.process_state import STATE, LoadTarget
from ..training import optimizer_layouts
from ..training.frozen_resume import carry_optimizer_state_over_freeze
from ..training.restore_choice import resolve_restore
from ..training.resume_policy import CHANGES_FUNCTION, check_resume_policy
from ..training.training_save_dir import claim_save_dir
from ..training.upcycling import check_upcycle_start, load_upcycled
from . import routing_stats
from .inference import current_run, load_sharded
from .precision import RESUMING
from .run_dtype import built_for_load, cast_for_inference, check_loaded, dtype_for_load
from .saving import is_expert_parallel_trainer
from .training import check_training_setup

logger = logging.getLogger(__name__)
# fairseq's Trainer.load_checkpoint asserts that the saved optimizer class is the one it built (a traceback).
OPTIMIZER_MISMATCH = re.compile(r"Optimizer does not match; .*\(--reset-optimizer\)\. (\S+) vs (\S+)$")


def wrap_load_checkpoint_to_cpu(original):
    def load_one(path, arg_overrides=None, verified=False, **kwargs):
        """fairseq's load of one file; ``verified``: its sha256 was just checked against a manifest."""
        return moe_ckpt.safe_load(path, lambda p: original(p, arg_overrides, **kwargs), verified=verified, mapped=True)

    @functools.wraps(original)
    def load_checkpoint_to_cpu(path, arg_overrides=None, **kwargs):
        return load_moe_checkpoint(load_one, path, arg_overrides, **kwargs)

    return load_checkpoint_to_cpu


def load_moe_checkpoint(original_load, path, arg_overrides=None, **kwargs):
    """A manifest path gives the merged set; inside Trainer.load_checkpoint, this worker's slice."""
    if not os.path.exists(path) or names_a_rank_file(path):
        # A set named without its rank suffix, or by one of its rank files (which alone holds only
        # one worker's experts): the whole set.
        resolved = moe_ckpt.resolve(path, fallback=False)
        path = resolved.path if resolved is not None else path
    target = STATE.load_targets[-1] if STATE.load_targets else None
    # Inside the load_model_ensemble_and_task hook (generation): experts gathered straight into the dtype the model
    # will run in, the optimizer state never read, each mapped file's pages given back once read.
    model_load = STATE.model_load
    into = None if model_load is None else model_load.experts_dtype
    merging = {} if model_load is None else dict(into=into, after_each=lambda: release_ranges(model_load.mappings))

    def for_inference(load, f):
        if into is None:
            return load()
        before = set(private_mappings([f]))
        state = load()
        made = set(private_mappings([f])) - before  # the mapping this load made
        model_load.mappings.extend((f, start, end) for start, end in made)
        if isinstance(state, dict):
            state.pop("last_optimizer_state", None)
        return state

    def load_listed(f):  # a file of a set, whose sha256 the resolve of the set checked
        return for_inference(lambda: original_load(f, arg_overrides, verified=True, **kwargs), f)

    if path.endswith(moe_ckpt.MANIFEST_SUFFIX):
        if target is None:
            return moe_ckpt.load_set(path, load_listed, **merging)
        state = load_share(path, target.rank, target.parallel_size, load_listed, **merging)  # this worker's share
    else:
        full = for_inference(lambda: original_load(path, arg_overrides, **kwargs), path)
        if into is not None and "moe" in full:
            for key in full["moe"].get("expert_keys", []):
                full["model"][key] = moe_ckpt.concatenated([full["model"][key]], **merging)
        if "moe" not in full:
            if target is not None and target.model is not None and expert_grads.has_experts(target.model):
                raise MoEOptionError(
                    f"{path} is a dense fairseq checkpoint (no MoE layers), which this MoE model cannot load: start "
                    f"an MoE from it with --moe-upcycle-from {path} and a new --save-dir, or train it on with its "
                    f"dense --arch"
                )
            return full
        moe_ckpt.check_whole(full, path)  # a rank file copied out of its set, under any name
        if target is None:
            return full
        state = moe_ckpt.shard_state(full, target.rank, target.parallel_size)
    if target.model is not None:  # None: an expert-sharded inference load (no model yet to compare)
        check_resumable(path, state, target.model, target.parallel_size, target.model_cfg)
        check_resume_policy(
            path,
            state.get("cfg"),
            target.model_cfg,
            target.criterion_cfg,
            allow_function_change=bool(moe_options(target.model_cfg).moe_allow_function_change),
        )
        carry_optimizer_state_over_freeze(path, state, target.model, target.model_cfg)
    return state


def names_a_rank_file(path) -> bool:
    return moe_ckpt.split_rank_suffix(path)[1] is not None


def wrap_trainer_load_checkpoint(original):
    @functools.wraps(original)
    def load_checkpoint(self, filename, *args, **kwargs):
        reset_optimizer = kwargs.get("reset_optimizer", args[0] if args else False)
        setattr(self, RESUMING, None if reset_optimizer else filename)  # hook 12 carries the optimizer over
        try:
            return load_moe_or_dense(self, filename, *args, **kwargs)
        except AssertionError as refused:
            mismatch = OPTIMIZER_MISMATCH.match(str(refused))
            if mismatch is None:
                raise
            raise optimizer_layouts.optimizer_mismatch(filename, *mismatch.groups()) from None
        finally:
            setattr(self, RESUMING, None)

    def load_moe_or_dense(self, filename, *args, **kwargs):
        check_training_setup(self)  # fairseq-train calls this first, before any batch is read
        checkpoint_cfg = self.cfg.checkpoint
        claim_save_dir(
            checkpoint_cfg.save_dir,
            checkpoint_cfg.no_save,
            self.data_parallel_rank,
            self.data_parallel_world_size,
            every_rank_saves=is_expert_parallel_trainer(self),
        )
        if not expert_grads.has_experts(self._model):
            return original(self, filename, *args, **kwargs)
        dense = moe_options(self.cfg.model).moe_upcycle_from
        if dense:
            check_upcycle_start(checkpoint_cfg)  # before the save dir's own checkpoint_last is looked for
        resolved = decided_on_rank_0(
            lambda: resolve_restore(
                filename,
                checkpoint_cfg,
                self.checkpoint_suffix,
                allow_fallback=bool(moe_options(self.cfg.model).moe_restore_fallback),
            )
        )
        if resolved is None:
            if dense:
                return load_upcycled(self, dense)  # the first launch of an upcycled run: nothing to resume
            return original(self, filename, *args, **kwargs)  # fairseq: "no existing checkpoint"
        if dense:
            logger.info(
                f"--moe-upcycle-from {dense} skipped: --save-dir {checkpoint_cfg.save_dir} holds "
                f"{resolved.path}, which this run resumes (a run is upcycled only at its first launch)"
            )
        layout = plan_of(self._model).layout
        logger.info(
            f"loading {resolved.kind} {resolved.path} as worker {layout.rank} of {layout.world_size} "
            f"(expert shard {layout.ep_rank} of {layout.parallel_size})"
        )
        STATE.load_targets.append(
            LoadTarget(layout.ep_rank, layout.parallel_size, self._model, self.cfg.model, self.cfg.criterion)
        )
        try:
            # Every worker builds its own slice, so nothing is broadcast from rank 0.
            with open_dict(self.cfg.checkpoint):
                previous = self.cfg.checkpoint.load_checkpoint_on_all_dp_ranks
                self.cfg.checkpoint.load_checkpoint_on_all_dp_ranks = True
            try:
                return original(self, resolved.path, *args, **kwargs)
            except Exception as refused:  # noqa: BLE001 - only a refusal to load is reworded, and re-raised
                if dense and refuses_the_checkpoint(refused):
                    raise upcycle_skipped(dense, checkpoint_cfg.save_dir, resolved.path, refused) from None
                raise
            finally:
                with open_dict(self.cfg.checkpoint):
                    self.cfg.checkpoint.load_checkpoint_on_all_dp_ranks = previous
        finally:
            STATE.load_targets.pop()

    return load_checkpoint


def refuses_the_checkpoint(error: BaseException) -> bool:
    """Our one-line refusals of a checkpoint this model cannot load, and fairseq's own (not the resume
    policy's: that checkpoint would load, and its line names its own fix)."""
    if CHANGES_FUNCTION in str(error):
        return False
    return isinstance(error, (ValueError, moe_ckpt.CheckpointError)) or str(error).startswith(
        "Cannot load model parameters from checkpoint"
    )


def upcycle_skipped(dense: str, save_dir: str, found: str, refused: BaseException) -> MoEOptionError:
    """--moe-upcycle-from was skipped for a checkpoint in the save dir, which turned out not to load."""
    problem = " ".join(str(refused).split()).split(": ", 1)[0]
    return MoEOptionError(
        f"--moe-upcycle-from {dense} was skipped because --save-dir {save_dir} already holds {found} (a restarted run "
        f"resumes its own checkpoint), and this model cannot load that one ({problem}): to upcycle, give this run a "
        f"new --save-dir"
    )


def decided_on_rank_0(decide):
    """``decide()`` run by rank 0 alone, its answer (or its one-line refusal) shared with every worker:
    the set is validated (every file hashed) once instead of once per worker, and every worker resumes
    from the same choice. The others wait for it on io_waits' gloo group, however long the hashing
    takes (an NCCL wait would be aborted by the watchdog after fairseq's 10 minutes)."""
    if (
        not (torch.distributed.is_available() and torch.distributed.is_initialized())
        or torch.distributed.get_world_size() == 1
    ):
        return decide()
    io_wait_group()  # made by every worker before rank 0 starts (new_group is collective)
    outcome = None
    if torch.distributed.get_rank() == 0:
        try:
            outcome = ("resolved", decide())
        except Exception as refused:  # noqa: BLE001  (every worker must stop with rank 0's error)
            outcome = ("refused", refused)
    kind, value = broadcast_from_rank_0(outcome)
    if kind == "refused":
        raise value from None
    return value


def wrap_load_model_ensemble_and_task(original):
    @functools.wraps(original)
    def load_model_ensemble_and_task(filenames, *args, **kwargs):
        resolved = []
        for name in filenames:
            # No fallback here: generating from another checkpoint than the one named would mislead.
            # A rank file stands for its whole set (alone it holds one worker's experts).
            named_set = not os.path.exists(name) or names_a_rank_file(name)
            found = moe_ckpt.resolve(name, fallback=False) if named_set else None
            resolved.append(found.path if found is not None else name)
        if STATE.teacher_load is not None:  # a distillation teacher (criterions/teacher.py)
            return load_teacher(original, resolved, STATE.teacher_load, *args, **kwargs)
        run = current_run()
        dtype = dtype_for_load(kwargs.get("arg_overrides", args[0] if args else None), run.dtype)
        # Experts on meta, filled from the checkpoint in the dtype they run in; every expert on each worker
        # unless the run keeps them sharded.
        with built_for_load(dtype, every_expert_local=run.sharded is None) as model_load:
            if run.sharded is not None:
                loaded = load_sharded(original, resolved, *args, **kwargs)
            else:
                loaded = original(resolved, *args, **kwargs)
        release_ranges(model_load.mappings)  # what the model took by reference is read again when used
        check_loaded(loaded[0], resolved)
        cast_for_inference(loaded[0], dtype)  # --fp16 / --bf16, before the CLI moves the model to a GPU
        if run.routing_stats is not None:  # --moe-routing-stats: the model's layers count their routing
            if len(loaded[0]) != 1:
                raise MoEOptionError("--moe-routing-stats counts one model, got an ensemble: pass one --path")
            routing_stats.attach(run.routing_stats, loaded[0][0], loaded[2] if len(loaded) > 2 else None)
        return loaded

    return load_model_ensemble_and_task


def load_teacher(original, filenames, teacher, *args, **kwargs):
    """Hook 8 for a distillation teacher: built for the load as generation builds a model (experts on meta, in the
    dtype it runs in), holding every expert or, spread over the training workers, this worker's share of them
    (``teacher.share``: read from the files holding it, as a resume reads a worker's share)."""
    with built_for_load(teacher.dtype, every_expert_local=teacher.share is None) as model_load:
        if teacher.share is not None:
            STATE.load_targets.append(teacher.share)
        try:
            loaded = original(filenames, *args, **kwargs)
        finally:
            if teacher.share is not None:
                STATE.load_targets.pop()
    release_ranges(model_load.mappings)
    check_loaded(loaded[0], filenames)
    cast_for_inference(loaded[0], teacher.dtype)
    return loaded
