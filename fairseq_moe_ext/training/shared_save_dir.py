"""Every worker of a multi-worker MoE job writes its own rank files into --save-dir, and rank 0
writes the manifest that lists them all: the directory must be one directory for every worker.

A node-local path (``/tmp/ck`` on each node) trains fine and then leaves every set incomplete on
every node, so this is checked before training: rank 0 writes a file with a fresh token, every
worker reads it back, and the job stops with one line if one of them does not see it. Nothing here
imports fairseq; the collectives take ``group=None`` (the default group) as everywhere else.
"""

import os
import uuid

import torch.distributed as dist

from ..common.refusal import MoERefusal

PROBE_NAME = "fairseq-moe-ext.shared-check"


class SaveDirNotSharedError(MoERefusal, RuntimeError):
    """Not every worker sees the save dir rank 0 writes; one line naming it and the fix."""


def read_token(path: str):
    """What a worker finds at ``path`` (None if it cannot read it)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def check_save_dir_shared(save_dir: str, rank: int, group=None) -> None:
    """Collective: raise SaveDirNotSharedError on every worker unless all see rank 0's file."""
    path = os.path.join(save_dir, PROBE_NAME)
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=0, group=group)
    if rank == 0:
        with open(path, "w") as f:
            f.write(token[0])
    dist.barrier(group=group)
    seen = read_token(path) == token[0]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, seen, group=group)  # also: nobody reads after rank 0 removes it
    if rank == 0:
        os.remove(path)
    blind = [r for r, ok in enumerate(everyone) if not ok]
    if blind:
        raise SaveDirNotSharedError(
            f"worker(s) {', '.join(map(str, blind))} of {len(everyone)} do not see the file worker 0 wrote into "
            f"--save-dir {save_dir}: a multi-worker save dir must be on a filesystem all workers share; put "
            f"--save-dir on a shared filesystem, mounted at the same path on every node"
        )
