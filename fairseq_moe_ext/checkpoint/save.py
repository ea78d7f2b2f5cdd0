"""The save of a checkpoint set, as one transaction read top to bottom.

A set has one file per expert shard: with W workers and expert-parallel size P, the P workers of the
first replica group each write their shard's file (when W > P the other workers hold replicas and
write nothing, but report a digest of their experts); rank 0 then writes the set's manifest. The
order below is what keeps a run loadable whenever a worker is killed:

1. protect: every complete set the save may overwrite is hard-linked as ``<name>.prev`` (rank 0
   decides which, so all workers link the same sets), a barrier, rank 0 writes the ``.prev``
   manifests, a barrier. Only then may any worker overwrite a file.
2. write: each worker writes its files (fairseq's save); files it would prune are only recorded.
3. describe: each worker reports what it wrote (name, size, sha256) and what it would prune.
4. manifests: rank 0 writes one manifest per complete set, drops the manifests of pruned sets and
   the ``.prev`` generations.
5. a barrier, then each worker deletes its pruned files: no manifest ever lists a deleted file.

The collectives come in as values (``Collectives``), so the protocol runs the same under
torch.distributed, under threads in a test, or in one process. Nothing here imports fairseq.
"""

import collections
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from .generations import link_previous_generation, remove_previous_generations, sets_to_protect, write_previous_manifest
from .manifest import describe_file, write_manifest
from .names import PREVIOUS, base_of, manifest_path
from .resolve import remove_other_layouts
from .set_id import agreed_set_id

logger = logging.getLogger(__name__)

Result = TypeVar("Result")


# fmt: off
@dataclass(frozen=True)
class Collectives:
    """What a save needs from the workers' process group."""

    rank: int
    world_size: int
    broadcast: Callable[[Any], Any]  # rank 0's value, returned on every worker
    all_gather: Callable[[Any], List[Any]]  # every worker's value, in rank order
    barrier: Callable[[], None]
# fmt: on


@dataclass(frozen=True)
class SetDescription:
    """What the manifest of every set saved now records beside its files."""

    num_updates: int
    num_experts: Dict[str, int]  # expert parameter name -> experts over all workers
    set_id: Optional[str]  # this worker's id of the save (see set_id.py)


@dataclass(frozen=True)
class WorkerShare:
    """This worker's part of the set."""

    shard: int  # the expert shard it holds, 0..shards-1 (its rank within its expert-parallel group)
    shards: int  # the set's files: the expert-parallel size P
    writes: bool  # the first replica of each shard writes the shard's file
    expert_digest: Optional[str] = None  # sha256 of its experts, when shards have several replicas


def save_rank_files(
    save_dir: str,
    suffix: str,
    comm: Collectives,
    describe: SetDescription,
    write: Callable[[], Tuple[Result, List[str]]],
    share: Optional[WorkerShare] = None,
) -> Result:
    """Run ``write`` (this worker's part of the save, returning its result and the paths it would
    have pruned) inside the transaction; ``suffix`` ends the names of this worker's files. Without
    ``share``, every worker writes its own shard (P = W)."""
    share = share or WorkerShare(comm.rank, comm.world_size, writes=True)
    before = own_files(save_dir, suffix) if share.writes else {}
    protect_previous_generation(save_dir, comm, share)
    result, pruned = write()
    written = (
        [
            dict(describe_file(os.path.join(save_dir, name)), rank=share.shard, set_id=describe.set_id)
            for name in changed_files(save_dir, suffix, before)
        ]
        if share.writes
        else []
    )
    reports = comm.all_gather((written, [os.path.basename(p) for p in pruned], (share.shard, share.expert_digest)))
    if comm.rank == 0:
        write_manifests(save_dir, reports, describe, share.shards)
        remove_previous_generations(save_dir)
    # No worker deletes a file of a pruned set before rank 0 has dropped the manifest listing it:
    # a crash in between leaves unlisted files (pruned again by the next save), never a manifest
    # that lists missing files, which no later save would ever clean up.
    comm.barrier()
    for path in pruned:
        if os.path.lexists(path):
            os.remove(path)
    return result


def save_single_file(save_dir: str, suffix: str, write: Callable[[], Result]) -> Result:
    """A one-worker save of an MoE model: fairseq's own file, holding every expert. What an earlier
    run with another world size left under the same name goes (two layouts for one name)."""
    before = own_files(save_dir, suffix)
    result = write()
    for name in changed_files(save_dir, suffix, before):
        remove_other_layouts(base_of(os.path.join(save_dir, name)), parallel_size=1)
    return result


def protect_previous_generation(save_dir: str, comm: Collectives, share: WorkerShare) -> None:
    """Hard-link every worker's files of every complete set to ``<name>.prev`` and write the ``.prev``
    manifests, before any worker overwrites one of them. The barriers make it hold across workers:
    without them one worker could overwrite its file before another had linked its own, and a kill
    then would leave neither generation complete."""
    manifests = comm.broadcast(sets_to_protect(save_dir) if comm.rank == 0 else None)
    if share.writes:
        for manifest in manifests:
            link_previous_generation(manifest, share.shard, share.shards)
    comm.barrier()
    if comm.rank == 0:
        for manifest in manifests:
            write_previous_manifest(manifest, share.shards)
    comm.barrier()


def write_manifests(save_dir: str, reports: List[Tuple], describe: SetDescription, shards: int) -> None:
    """Rank 0: one manifest for every set all shards wrote, none for the sets they pruned."""
    workers = len(reports)
    replicas = [[digest for _, _, (shard, digest) in reports if shard == s] for s in range(shards)]
    replicas = replicas if workers > shards and all(d is not None for r in replicas for d in r) else None
    by_base = collections.defaultdict(list)
    for written, _, _ in reports:
        for entry in written:
            by_base[base_of(os.path.join(save_dir, entry["name"]))].append(entry)
    for base, entries in by_base.items():
        if sorted(e["rank"] for e in entries) == list(range(shards)):
            write_manifest(
                base,
                shards,
                describe.num_updates,
                entries,
                describe.num_experts,
                agreed_set_id(base, entries),
                workers=workers,
                replicas=replicas,
            )
            remove_other_layouts(base, shards)
        else:
            ranks = sorted(e["rank"] for e in entries)
            logger.warning(f"checkpoint {base}: only ranks {ranks} wrote files; no manifest")
    for _, removed, _ in reports:
        for name in removed:
            manifest = manifest_path(base_of(os.path.join(save_dir, name)))
            if os.path.exists(manifest):
                os.remove(manifest)


def own_files(save_dir: str, suffix: str) -> Dict[str, Tuple[int, int, int]]:
    """This worker's checkpoint files (names ending in ``suffix.pt``), with what tells a rewrite."""
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return {}
    ending = suffix + ".pt"
    files = {}
    for name in names:
        if name.endswith(ending):
            st = os.stat(os.path.join(save_dir, name))
            files[name] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return files


def changed_files(save_dir: str, suffix: str, before: Dict[str, Tuple[int, int, int]]) -> List[str]:
    """The files of this worker written since ``before`` (new, or rewritten in place or by rename).
    The ``.prev`` links made by protect_previous_generation are the old generation, not this save's."""
    return [
        name
        for name, stamp in own_files(save_dir, suffix).items()
        if before.get(name) != stamp and not base_of(name).endswith(PREVIOUS)
    ]
