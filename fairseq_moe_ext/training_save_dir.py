"""What fairseq-train checks about --save-dir before it reads or writes a checkpoint: that no other
job writes there (save_dir_lock), and that every worker of a multi-worker MoE job sees the same
directory (shared_save_dir). Called from the Trainer.load_checkpoint hook with plain values."""

import atexit
import os

from . import save_dir_lock
from .shared_save_dir import check_save_dir_shared


def claim_save_dir(save_dir: str, no_save: bool, rank: int, every_rank_saves: bool) -> None:
    """``every_rank_saves``: an expert-parallel job, whose workers all write rank files."""
    if no_save:
        return  # nothing will be written: runs with --no-save may share a directory
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)  # fairseq-train made it already; other callers may not have
        holder = save_dir_lock.acquire(save_dir)
        atexit.register(save_dir_lock.release, save_dir, holder)
    if every_rank_saves:
        check_save_dir_shared(save_dir, rank)
