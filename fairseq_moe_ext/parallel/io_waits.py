"""Where workers wait for another worker's checkpoint file work: on a gloo group of their own, with
a timeout of hours, instead of fairseq's default process group.

Rank 0 alone resolves the checkpoint to resume (reading and hashing every file of the set, and of
every complete set in the directory when it falls back), and a save writes and hashes each worker's
files, rank 0's the largest (the shared state and its optimizer state). The others wait meanwhile.
On GPUs fairseq's default group is NCCL: a wait there is an enqueued collective, and the watchdog
aborts every worker once it runs past the group's timeout (10 minutes, torch's NCCL default, which
fairseq keeps), while hashing a few hundred GB from a network filesystem takes longer than that.

These waits therefore run on a gloo group made for them (``io_wait_group``): the host waits, no GPU
work is pending, no watchdog is involved. A worker that dies still fails the others at once (gloo
sees its connection close); only a worker stuck inside a read (a hung filesystem) is waited for as
long as ``IO_WAIT_TIMEOUT`` (4 hours: 1.4 TB hashed at 100 MB/s).

Considered and not taken: every worker hashing a share of the files in parallel divides the time
by the world size but bounds nothing (one large file 0 still takes what it takes); hashing a sample
of each file, or trusting sizes at resume, would load a corrupted or foreign file the manifest's
sha256 now refuses; a longer timeout for fairseq's default group is not ours to set (fairseq
creates it). Nothing here imports fairseq.
"""

from datetime import timedelta
from typing import Any, List

import torch.distributed as dist

from .process_state import STATE

IO_WAIT_TIMEOUT = timedelta(hours=4)


def io_wait_group():
    """The gloo group over every worker for waits on file work (made once per default group; a
    collective the first time, as torch's new_group is)."""
    return STATE.process_groups.io_wait_group(lambda: dist.new_group(backend="gloo", timeout=IO_WAIT_TIMEOUT))


def broadcast_from_rank_0(value: Any) -> Any:
    """Rank 0's ``value`` on every worker (by pickle); the others wait for it as long as it takes."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=io_wait_group())
    return box[0]


def all_gather_objects(value: Any) -> List[Any]:
    """Every worker's ``value``, in rank order."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=io_wait_group())
    return gathered


def barrier() -> None:
    dist.barrier(group=io_wait_group())
