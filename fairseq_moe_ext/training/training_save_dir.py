"""What fairseq-train checks about --save-dir before it reads or writes a checkpoint: that no other
job writes there (save_dir_lock), and that every worker of a multi-worker MoE job sees the same
directory (shared_save_dir). Called from the Trainer.load_checkpoint hook with plain values."""

import atexit
import os

import torch.distributed as dist

from . import save_dir_lock
from .shared_save_dir import check_save_dir_shared


def claim_save_dir(save_dir: str, no_save: bool, rank: int, world_size: int, every_rank_saves: bool) -> None:
    """``every_rank_saves``: an expert-parallel job, whose workers all write rank files."""
    if no_save:
        return  # nothing will be written: runs with --no-save may share a directory
    refusal = [None]
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)  # fairseq-train made it already; other callers may not have
        try:
            holder = save_dir_lock.acquire(save_dir)
            atexit.register(save_dir_lock.release, save_dir, holder)
        except save_dir_lock.SaveDirLockedError as refused:
            refusal = [str(refused)]
    if world_size > 1 and dist.is_initialized():
        # Every worker stops with rank 0's line, instead of the others failing later in a
        # collective with a connection error that hides it.
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise save_dir_lock.SaveDirLockedError(refusal[0])
    if every_rank_saves:
        check_save_dir_shared(save_dir, rank)
