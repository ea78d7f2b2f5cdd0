"""Resume reads only a worker's share of a set: the first file (the shared state) and the files that
hold the worker's experts, instead of merging every file and then slicing.

A set of S files splits E experts evenly (file f holds experts f*E/S ...); worker r of W' takes
experts r*E/W' ... . When the layout is unchanged (W' = S) that is file 0 and file r. The files'
sizes and sha256s were checked once, by whoever resolved the set (rank 0 in training, which shares
its verdict), so nothing here hashes or re-reads a file.
"""

import os
from typing import Callable, Dict, Optional

import torch

from .contents import check_rank_states
from .errors import CheckpointSetError
from .manifest import differing_replicas, read_manifest
from .reshard import merge_states, refuse_unsplittable, take_expert_rows


def files_holding(shards: int, rank: int, parallel_size: int) -> range:
    """The files of an S-file set that hold the experts of worker ``rank`` of ``parallel_size`` (P)."""
    first = rank * shards // parallel_size
    last = -(-(rank + 1) * shards // parallel_size) - 1
    return range(first, last + 1)


def load_share(
    manifest_file: str,
    rank: int,
    parallel_size: int,
    load_fn: Callable[[str], Dict],
    into: Optional[torch.dtype] = None,
    after_each: Optional[Callable[[], object]] = None,
) -> Dict:
    """What worker ``rank`` of ``parallel_size`` (P) loads from the set: shard_state(load_set(...), rank,
    parallel_size), reading only the files it needs (``into``, ``after_each``: as merge_states)."""
    manifest = read_manifest(manifest_file)
    differing = differing_replicas(manifest)
    if differing:
        raise CheckpointSetError(
            f"{manifest_file}: the replicas of expert shard(s) {differing} differed when the set was saved (a bug in "
            f"training, reported by inspect): resume from an earlier set, or merge this one (fairseq-moe merge, "
            f"which keeps replica 0's experts) and pass the merged file as "
            f"--restore-file"
        )
    shards, directory = manifest["world_size"], os.path.dirname(manifest_file)
    entries = {entry["rank"]: entry for entry in manifest["files"]}
    span = files_holding(shards, rank, parallel_size)
    rows = {}
    for key, total in manifest["num_experts"].items():  # refused before any file is read
        refuse_unsplittable(key, total, parallel_size)
        per_file, per_worker = total // shards, total // parallel_size
        rows[key] = (len(span) * per_file, rank * per_worker - span.start * per_file, per_worker)
    needed = sorted({0, *span})
    loaded = {f: load_fn(os.path.join(directory, entries[f]["name"])) for f in needed}
    check_rank_states(dict(manifest, files=[entries[f] for f in needed]), [loaded[f] for f in needed], directory)
    held = merge_states([loaded[f] for f in span], shared=loaded[0], into=into, after_each=after_each)
    if set(rows) != set(held["moe"]["expert_keys"]) or any(
        tuple(held["model"][key].shape[:1]) != (rows[key][0],) for key in rows
    ):
        raise CheckpointSetError(
            f"{manifest_file}: its num_experts {manifest['num_experts']} do not match the experts its files hold: the "
            f"manifest was edited or damaged; restore it from a backup, or move the set out of the directory"
        )
    return take_expert_rows(held, rows, rank, parallel_size)
