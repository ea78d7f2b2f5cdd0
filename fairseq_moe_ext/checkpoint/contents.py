"""What a loaded checkpoint file holds: a fairseq checkpoint at all, a dense one, a whole MoE
checkpoint, or one rank's part of a set.

Rank files are self-describing (``state["moe"]``: rank, world size, ``experts_held``, ``set_id``),
so a part copied out of its set, or renamed to look like a single-file checkpoint, is recognised
on its own and refused instead of loading as a model with a fraction of its experts.

The set id (``set_id.py``) names one save. Files written before set ids existed carry none, and
the checks skip them.

Everything here looks at a state already loaded (safe_load.py loads files).
"""

import os
from typing import Dict, List, Optional

from .errors import CheckpointSetError, NotACheckpointError
from .names import split_rank_suffix


def experts_held(rank: int, experts_per_worker: int) -> List[int]:
    """The global ids of the experts worker ``rank`` holds (ids in rank order, as merging puts them)."""
    return list(range(rank * experts_per_worker, (rank + 1) * experts_per_worker))


def check_is_checkpoint(state, path: str) -> Dict:
    """``state`` if it is a fairseq checkpoint (a dict holding the model's state), else one line."""
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        return state
    what = (
        f"a dict without a model state (keys {sorted(map(str, state))[:5]})"
        if isinstance(state, dict)
        else f"a {type(state).__module__}.{type(state).__name__}".replace("builtins.", "")
    )
    raise NotACheckpointError(
        f"{path} is not a fairseq checkpoint: it holds {what}; point --path / --restore-file (or the checkpoint "
        f"tool) at a checkpoint written by fairseq-train"
    )


def is_dense(state: Dict) -> bool:
    """A fairseq checkpoint without MoE layers (written by a plain model, or by stock fairseq)."""
    return "moe" not in state


def describe_part(meta: Dict, path: Optional[str] = None) -> str:
    """``rank 1 of 2 of checkpoint_last (set 0123..., update 8, experts 2-3)``."""
    base = os.path.basename(split_rank_suffix(path)[0]) if path and split_rank_suffix(path)[1] is not None else None
    held = meta.get("experts_held")
    parts = [
        f"set {meta['set_id']}" if meta.get("set_id") else "set id unknown (an older file)",
        f"update {meta.get('num_updates')}",
    ]
    if held:
        parts.append(f"experts {held[0]}-{held[-1]}" if len(held) > 1 else f"expert {held[0]}")
    of = f" of {base}" if base else ""
    return f"rank {meta.get('rank')} of {meta.get('world_size')}{of} ({', '.join(parts)})"


def check_whole(state: Dict, path: str) -> Dict:
    """``state`` unless it is one rank's part of a multi-worker set (loaded on its own)."""
    meta = state.get("moe") or {}
    world = meta.get("world_size")
    if isinstance(world, int) and world > 1:
        raise CheckpointSetError(
            f"{path} is one part of a checkpoint set, not a whole checkpoint: {describe_part(meta, path)}; put it "
            f"back beside its set's other rank files and manifest, and pass the set's name (or merge the set with "
            f"fairseq-moe merge)"
        )
    return state


def check_belongs_to_set(meta: Dict, name: str, manifest: Dict) -> None:
    """A rank file's own set id against its manifest's (skipped where either predates set ids)."""
    own, listed = meta.get("set_id"), manifest.get("set_id")
    if own and listed and own != listed:
        raise CheckpointSetError(
            f"{name} belongs to set {own}, but the manifest's set is {listed}: a file from another save; restore "
            f"the set's own file from a backup, or point --path / --restore-file at another checkpoint"
        )


def check_rank_states(manifest: Dict, states: List, directory: str) -> None:
    """Every loaded rank file is a checkpoint and says it is the rank, save and set its manifest lists."""
    for f, state in zip(manifest["files"], states):
        check_is_checkpoint(state, os.path.join(directory, f["name"]))
        meta = state.get("moe") if isinstance(state.get("moe"), dict) else {}
        if meta.get("rank") != f["rank"] or meta.get("world_size") != manifest["world_size"]:
            raise CheckpointSetError(
                f"{f['name']} says it is rank {meta.get('rank')} of {meta.get('world_size')}, not rank {f['rank']} "
                f"of {manifest['world_size']}: a file from another run?"
            )
        if meta.get("num_updates") != manifest["num_updates"]:
            raise CheckpointSetError(
                f"{f['name']} holds update {meta.get('num_updates')} but the set is update "
                f"{manifest['num_updates']}: files from different saves"
            )
        check_belongs_to_set(meta, f["name"], manifest)
