"""Hooks 5 and 6: in multi-worker MoE training every worker saves its own rank file, and fairseq's
save runs inside the checkpoint-set transaction (``checkpoint/save.py``). Every save through the
hook, an MoE model's or a dense one's, copies by rename and reports a failed write (a full disk) in
one line (``checkpoint/write_failure.py``), with its half-written files removed."""

import contextlib
import functools
import hashlib
import os

import torch

from fairseq import checkpoint_utils

from .. import checkpoint as moe_ckpt
from ..checkpoint.errors import CheckpointError
from ..checkpoint.save import Collectives, SetDescription, WorkerShare, save_rank_files, save_single_file
from ..checkpoint.write_failure import cannot_write, is_write_failure, remove_new_partial_files
from ..parallel import expert_grads, fully_sharded, io_waits
from ..parallel.plan import plan_of
from ..parallel.process_state import STATE
from ..training.set_identity import save_set_id
from . import sharding


def is_expert_parallel_trainer(trainer) -> bool:
    """Are this trainer's experts split over several workers, each shard saved in its own rank file?"""
    cached = STATE.expert_parallel_trainers.get(trainer)
    if cached is None:
        cached = (
            trainer.data_parallel_world_size > 1
            and expert_grads.has_experts(trainer._model)
            and plan_of(trainer._model).layout.parallel_size > 1
        )
        STATE.expert_parallel_trainers[trainer] = cached
    return cached


def wrap_checkpoint_suffix(original_fget):
    def checkpoint_suffix(self):
        suffix = original_fget(self)
        if is_expert_parallel_trainer(self):
            layout = plan_of(self._model).layout
            suffix += moe_ckpt.rank_suffix(layout.ep_rank, layout.parallel_size)
        return suffix

    return checkpoint_suffix


def wrap_should_save(original_fget):
    def should_save_checkpoint_on_current_rank(self):
        if is_expert_parallel_trainer(self):
            return plan_of(self._model).layout.replica_index == 0  # one file per expert shard
        return original_fget(self)

    return should_save_checkpoint_on_current_rank


def wrap_trainer_state_dict(original):
    @functools.wraps(original)
    def state_dict(self):
        state = sharding.gather_full_state(self, original(self))  # FSDP2's slices made whole
        if not expert_grads.has_experts(self._model):
            return state
        layout = plan_of(self._model).layout
        world, rank = (layout.parallel_size, layout.ep_rank) if is_expert_parallel_trainer(self) else (1, 0)
        names = [n for n, p in self._model.named_parameters() if p.requires_grad]
        experts = [p for p in self._model.parameters() if expert_grads.is_expert(p)]
        state["moe"] = moe_ckpt.moe_metadata(
            names,
            expert_grads.expert_parameter_names(self._model),
            world,
            rank,
            self.get_num_updates(),
            set_id=save_set_id(self, self.data_parallel_world_size),
            experts_per_worker=int(experts[0].shape[0]) if experts else None,
        )
        if rank > 0:
            moe_ckpt.strip_shared_state(state)
        return state

    return state_dict


def wrap_save_checkpoint(original):
    @functools.wraps(original)
    def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
        if cfg.no_save:
            return original(cfg, trainer, epoch_itr, val_loss)
        with _write_failures_reported(cfg.save_dir, trainer):
            return save(cfg, trainer, epoch_itr, val_loss)

    def save(cfg, trainer, epoch_itr, val_loss):
        if not expert_grads.has_experts(trainer._model) or not is_expert_parallel_trainer(trainer):
            if trainer.data_parallel_rank > 0:  # every parameter on every worker: rank 0 saves them
                return original(cfg, trainer, epoch_itr, val_loss)
            with _atomic_copies():
                if not expert_grads.has_experts(trainer._model):
                    return original(cfg, trainer, epoch_itr, val_loss)
                return save_single_file(
                    cfg.save_dir, trainer.checkpoint_suffix, lambda: original(cfg, trainer, epoch_itr, val_loss)
                )

        def write():
            with _atomic_copies(), _removals_deferred() as pruned:
                return original(cfg, trainer, epoch_itr, val_loss), pruned

        layout = plan_of(trainer._model).layout
        describe = SetDescription(
            num_updates=trainer.get_num_updates(),
            num_experts={
                n: int(p.shape[0]) * layout.parallel_size
                for n, p in trainer._model.named_parameters()
                if expert_grads.is_expert(p)
            },
            set_id=save_set_id(trainer, trainer.data_parallel_world_size),
        )
        share = WorkerShare(
            layout.ep_rank,
            layout.parallel_size,
            writes=layout.replica_index == 0,
            expert_digest=expert_digest(trainer._model) if layout.num_replicas > 1 else None,
        )
        return save_rank_files(
            cfg.save_dir, trainer.checkpoint_suffix, torch_collectives(trainer), describe, write, share
        )

    return save_checkpoint


@contextlib.contextmanager
def _write_failures_reported(save_dir: str, trainer):
    """A failed write of this worker's save (a full disk, a save dir made read-only) becomes one line
    naming the cause and the fix, and the ``.tmp`` files it left half-written are removed (every file
    of a save is written under ``<name>.tmp`` and renamed, so no complete checkpoint is touched)."""
    try:
        before = set(os.listdir(save_dir))
    except OSError:
        before = set()
    try:
        yield
    except (OSError, RuntimeError, AssertionError) as e:  # AssertionError: fairseq's check of a failed copy
        if isinstance(e, CheckpointError) or not (is_write_failure(e) or _failed_copy(e)):
            raise
        report = cannot_write(
            e,
            f"the checkpoint of update {trainer.get_num_updates()}",
            save_dir,
            writable_fix="give --save-dir a directory you can write to",
            then="then rerun the same command (it resumes from the last checkpoint saved whole; the half-written "
            "files of this save were removed)",
        )
        if trainer.should_save_checkpoint_on_current_rank:  # a replica that writes nothing removes nothing
            endings = [trainer.checkpoint_suffix + ".pt.tmp"]
            endings += [".set.json.tmp"] if trainer.data_parallel_rank == 0 else []
            remove_new_partial_files(save_dir, before, endings)
        raise report from None


def _failed_copy(error: BaseException) -> bool:
    return isinstance(error, AssertionError) and str(error).startswith("Failed to copy")


def expert_digest(model) -> str:
    """sha256 of this worker's expert parameters (replicas of one shard must give the same); None
    where they are sharded over their replicas (--moe-fully-sharded-experts: one copy, nothing to compare)."""
    if any(fully_sharded.is_sharded(p) for p in model.parameters() if expert_grads.is_expert(p)):
        return None
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        if expert_grads.is_expert(p):
            digest.update(name.encode())
            digest.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def torch_collectives(trainer) -> Collectives:
    """The save's collectives (objects travel by pickle), on io_waits' gloo group: the workers wait
    there for each other's writing and hashing (rank 0's file is the largest), which on fairseq's
    NCCL group the watchdog would abort after its timeout."""
    return Collectives(
        trainer.data_parallel_rank,
        trainer.data_parallel_world_size,
        io_waits.broadcast_from_rank_0,
        io_waits.all_gather_objects,
        io_waits.barrier,
    )


@contextlib.contextmanager
def _atomic_copies():
    """fairseq copies checkpoint N-1 times with PathManager.copy, which rewrites the destination in
    place; copy to a temporary name and rename instead, so no reader ever sees a half-written file
    and the ``.prev`` hard links keep their contents."""
    inner = checkpoint_utils.PathManager

    class AtomicCopyPathManager:
        def __getattr__(self, name):
            return getattr(inner, name)

        @staticmethod
        def copy(src, dst, overwrite=False):
            tmp = dst + ".tmp"
            # iopath's copy logs a failure and returns False: then the half-written copy must not
            # replace the destination (fairseq asserts on the False).
            if not inner.copy(src, tmp, overwrite=True):
                return False
            os.replace(tmp, dst)
            return True

    checkpoint_utils.PathManager = AtomicCopyPathManager()
    try:
        yield
    finally:
        checkpoint_utils.PathManager = inner


@contextlib.contextmanager
def _removals_deferred():
    """fairseq prunes old checkpoints (--keep-interval-updates, --keep-last-epochs,
    --keep-best-checkpoints) with ``os.remove`` inside save_checkpoint, each worker on its own
    schedule; collect those paths instead, so the transaction removes them after the manifests."""
    real_os, pruned = checkpoint_utils.os, []

    class RemovalDeferringOs:
        def __getattr__(self, name):
            return getattr(real_os, name)

        @staticmethod
        def remove(path):
            pruned.append(path)

    checkpoint_utils.os = RemovalDeferringOs()
    try:
        yield pruned
    finally:
        checkpoint_utils.os = real_os
