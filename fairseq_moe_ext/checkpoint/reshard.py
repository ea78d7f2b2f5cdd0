"""Between layouts: a set is merged into one full state (all experts, ids in rank order), and a
full state is sliced for worker r of W' (experts ``r*E/W' ...``, optimizer state alike) or written
as a W'-file set. ``load_full`` loads either layout whole, for the checkpoint tool.
"""

import copy
import functools
import os
from typing import Callable, Dict, List, Optional

import torch

from .contents import check_is_checkpoint, check_rank_states, check_whole, experts_held, is_dense
from .errors import CheckpointSetError
from .manifest import read_manifest, validate_set
from .names import base_of, manifest_path
from .rank_state import strip_shared_state
from .resolve import resolve
from .safe_load import safe_load
from .set_writer import write_shards


def load_set(
    manifest_file: str, load_fn: Optional[Callable[[str], Dict]] = None, check: bool = True, **merging
) -> Dict:
    """Merge a set into one full state (what a single process holding every expert would save); ``merging``:
    merge_states' ``into`` and ``after_each``."""
    manifest = validate_set(manifest_file, check_digests=check) if check else read_manifest(manifest_file)
    if load_fn is None:
        load_fn = functools.partial(safe_load, verified=check)
    directory = os.path.dirname(manifest_file)
    states = [load_fn(os.path.join(directory, f["name"])) for f in manifest["files"]]
    check_rank_states(manifest, states, directory)
    return merge_states(states, **merging)


def merge_states(
    states: List[Dict],
    shared: Optional[Dict] = None,
    into: Optional[torch.dtype] = None,
    after_each: Optional[Callable[[], object]] = None,
) -> Dict:
    """Rank states (rank order) -> full state: shared parts from ``shared`` (default: the first,
    rank 0's), experts concatenated (``into``: in that dtype, cast part by part; ``after_each``: called
    after each part was read, e.g. to give back a memory-mapped file's pages)."""
    shared = states[0] if shared is None else shared
    full = copy.copy(shared)
    meta = full["moe"]
    full["model"] = dict(shared["model"])
    for key in meta["expert_keys"]:
        full["model"][key] = concatenated([s["model"][key] for s in states], into, after_each)
    optimizer = shared.get("last_optimizer_state")
    if isinstance(optimizer, dict) and "state" in optimizer:
        merged = dict(optimizer)
        merged["state"] = dict(optimizer["state"])
        for slot in meta["optimizer_expert_slots"]:
            per_rank = [s["last_optimizer_state"]["state"].get(slot) for s in states]
            if all(p is not None for p in per_rank):
                merged["state"][slot] = _concat_slot(per_rank, states, meta, slot)
        full["last_optimizer_state"] = merged
    full["moe"] = dict(meta, world_size=1, rank=0)
    if "experts_held" in meta:
        full["moe"]["experts_held"] = experts_held(0, _experts_in(full))
    return full


def concatenated(parts: List[torch.Tensor], into: Optional[torch.dtype] = None, after_each=None) -> torch.Tensor:
    """``torch.cat(parts)`` in dtype ``into`` (default: theirs) without a temporary: one part is returned as it is
    (cast if asked), several are copied into one tensor part by part."""
    into = into or parts[0].dtype
    if len(parts) == 1:
        whole = parts[0].to(into)
        if after_each is not None and whole is not parts[0]:
            after_each()
        return whole
    out = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=into)
    row = 0
    for part in parts:
        out[row : row + part.shape[0]].copy_(part)
        row += part.shape[0]
        if after_each is not None:
            after_each()
    return out


def _experts_in(full: Dict) -> int:
    counts = [int(full["model"][k].shape[0]) for k in full["moe"]["expert_keys"] if k in full["model"]]
    return counts[0] if counts else 0


def _concat_slot(per_rank, states, meta, slot):
    name = meta["optimizer_param_names"][slot]
    local_rows = states[0]["model"][name].shape[0] if name in states[0]["model"] else None
    out = {}
    for key, value in per_rank[0].items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == local_rows:
            out[key] = torch.cat([p[key] for p in per_rank])
        else:
            out[key] = value
    return out


def refuse_unsplittable(key: str, total: int, parallel_size: int) -> None:
    if total % parallel_size:
        raise CheckpointSetError(
            f"{key} holds {total} experts, which cannot be split over {parallel_size} workers: use a "
            f"world size dividing {total}"
        )


def shard_state(full: Dict, rank: int, parallel_size: int) -> Dict:
    """Full state -> what worker ``rank`` of ``parallel_size`` (P) loads (its experts, shared parts)."""
    rows = {}
    for key in full["moe"]["expert_keys"]:
        total = full["model"][key].shape[0]
        refuse_unsplittable(key, total, parallel_size)
        rows[key] = (total, rank * (total // parallel_size), total // parallel_size)
    return take_expert_rows(full, rows, rank, parallel_size)


def take_expert_rows(state: Dict, rows: Dict[str, tuple], rank: int, parallel_size: int) -> Dict:
    """``state`` with each expert tensor ``key`` (and its optimizer state) cut to ``count`` experts from
    ``start``, where ``rows[key] = (experts the tensor holds now, start, count)``; described as the
    part of worker ``rank`` of ``parallel_size`` (P; the file's ``world_size``)."""
    meta = state["moe"]
    out = copy.copy(state)
    out["model"] = dict(state["model"])
    for key, (held, start, count) in rows.items():
        out["model"][key] = taken(state["model"][key], held, start, count)
    optimizer = state.get("last_optimizer_state")
    if isinstance(optimizer, dict) and "state" in optimizer:
        sliced = dict(optimizer)
        sliced["state"] = dict(optimizer["state"])
        for slot in meta["optimizer_expert_slots"]:
            entry = optimizer["state"].get(slot)
            name = meta["optimizer_param_names"][slot]
            if entry is None or name not in rows:
                continue
            held, start, count = rows[name]
            sliced["state"][slot] = {
                k: (taken(v, held, start, count) if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == held else v)
                for k, v in entry.items()
            }
        out["last_optimizer_state"] = sliced
    counts = [count for _, _, count in rows.values()]
    out["moe"] = dict(meta, world_size=parallel_size, rank=rank)
    out["moe"]["experts_held"] = experts_held(rank, counts[0] if counts else 0)
    return out


def taken(tensor: torch.Tensor, held: int, start: int, count: int) -> torch.Tensor:
    """Rows ``start .. start + count`` of ``tensor`` (which holds ``held``): all of them as they are (no copy: a
    worker loading the layout it was saved with keeps the loaded, possibly memory-mapped, tensor), a part as a
    copy of its own (a view would keep the other rows' memory alive)."""
    if start == 0 and count == held:
        return tensor
    return tensor[start : start + count].clone()


def save_set(
    full: Dict, base: str, parallel_size: int, workers: Optional[int] = None, extra: Optional[Dict] = None
) -> str:
    """Write ``full`` as a set of ``parallel_size`` (P) rank files (expert shards: the format training writes)
    for ``workers`` workers (default: one per shard) and return the manifest path; ``extra``: more
    fields for the manifest (prune's record of what it kept)."""
    if parallel_size < 1:
        raise CheckpointSetError(f"a set needs a positive number of workers, got {parallel_size}")
    for key, total in experts_per_key(full).items():  # before the first file is written
        refuse_unsplittable(key, total, parallel_size)
    return write_shards(FullStateShards(full, parallel_size), base, workers=workers, extra=extra)


class FullStateShards:
    """The reader of a full state (set_writer.py): its ``shards`` rank files, each cut when it is asked for."""

    def __init__(self, full: Dict, shards: int):
        self.full, self.shards = full, shards
        self.num_updates, self.experts = full["moe"]["num_updates"], experts_per_key(full)

    def pieces(self, set_id: str):
        for rank in range(self.shards):
            state = shard_state(self.full, rank, self.shards)
            state["moe"]["set_id"] = set_id
            yield rank, state if rank == 0 else strip_shared_state(state)
            del state


def experts_per_key(full: Dict) -> Dict[str, int]:
    return {k: int(full["model"][k].shape[0]) for k in full["moe"]["expert_keys"]}


def load_full(path: str, load_fn: Optional[Callable[[str], Dict]] = None) -> Dict:
    resolved = resolve(path, fallback=False)
    if resolved is None:
        raise CheckpointSetError(
            f"no checkpoint named {path} (neither a file nor a set manifest {manifest_path(base_of(path))})"
        )
    if resolved.kind == "set":
        return load_set(resolved.path, load_fn)
    state = check_is_checkpoint((load_fn or safe_load)(resolved.path), resolved.path)
    if is_dense(state):
        raise CheckpointSetError(
            f"{resolved.path} is a dense fairseq checkpoint (no MoE layers): there are no experts to merge or "
            f"reshard; use the file as it is"
        )
    return check_whole(state, resolved.path)
