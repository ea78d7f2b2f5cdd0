"""What a checkpoint name refers to on disk: a complete set, a single file, or (when the named set
is incomplete and the name is fairseq's own) the newest complete set in its directory. A name never
stands for two layouts: a save removes what an earlier run with another world size left under it.
"""

import glob
import logging
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

from .contents import describe_part
from .errors import CheckpointSetError, load_another
from .foreign import readable_manifest
from .manifest import validate_set
from .names import MANIFEST_SUFFIX, RANK_SUFFIX_RE, base_of, manifest_path, split_rank_suffix
from .safe_load import peek_metadata

logger = logging.getLogger(__name__)


def complete_sets(directory: str) -> List[Dict]:
    """Every complete set in ``directory``, newest (most updates) first."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "*" + MANIFEST_SUFFIX)):
        if readable_manifest(path) is None:
            continue  # not ours, or not well-formed: warned once
        try:
            manifest = validate_set(path)
        except CheckpointSetError as e:
            logger.warning(f"ignoring checkpoint set {path}: {e}")
            continue
        found.append(dict(manifest, path=path))
    return sorted(found, key=lambda m: (m["num_updates"], os.path.getmtime(m["path"])), reverse=True)


@dataclass
class Resolved:
    """What a checkpoint name refers to on disk."""

    kind: str  # "set" or "file"
    path: str  # manifest path or the single file
    fallback_reason: Optional[str] = None


def resolve(path: str, fallback: bool = True) -> Optional[Resolved]:
    """Find what ``path`` (with or without rank suffix) names: a complete set, a single file, or
    (``fallback``) the newest complete set in its directory when the named set is incomplete.
    Without ``fallback`` (a name given by the user) a rank file must be one of its set's files."""
    base = base_of(path)
    single = base + ".pt"
    manifest = manifest_path(base)
    rank_files = glob.glob(glob.escape(base) + "-rank-*-of-*.pt")
    has_single = os.path.isfile(single) and not RANK_SUFFIX_RE.search(base)
    if has_single and (os.path.exists(manifest) or rank_files):
        raise CheckpointSetError(
            f"{single} exists beside per-rank files of the same name ({os.path.basename(manifest)} / "
            f"{len(rank_files)} rank files): two layouts for one checkpoint; move one of them away"
        )
    if has_single:
        return Resolved("file", single)
    if not os.path.exists(manifest) and not rank_files:
        return None
    try:
        found = validate_set(manifest) if os.path.exists(manifest) else _raise_no_manifest(manifest, rank_files)
    except CheckpointSetError as problem:
        if not fallback:
            raise CheckpointSetError(
                f"checkpoint set {manifest} cannot be loaded: {problem}; {load_another('the set')}"
            ) from None
        candidates = complete_sets(os.path.dirname(manifest) or ".")
        if not candidates:
            raise CheckpointSetError(
                f"checkpoint set {manifest} is unusable ({problem}) and no complete set exists in "
                f"{os.path.dirname(manifest) or '.'}: restore the set's files from a backup, or start afresh in a "
                f"new --save-dir"
            ) from None
        chosen = candidates[0]["path"]
        reason = f"checkpoint set {manifest} is unusable ({problem}); using the newest complete set {chosen}"
        logger.warning(reason)
        return Resolved("set", chosen, reason)
    if not fallback:
        # A name the user gave (--path, the checkpoint tool). fairseq-train's own name carries this
        # run's rank suffix and stands for the set whatever its world size: resuming reshards it.
        _check_named_rank_file(path, found, manifest)
    return Resolved("set", manifest)


def _check_named_rank_file(path, manifest, manifest_file):
    """A rank file named directly stands for its whole set, but only if that set lists it."""
    _, rank, world = split_rank_suffix(path)
    if rank is not None and world != manifest["world_size"]:
        raise CheckpointSetError(
            f"{path} is not part of the checkpoint set {manifest_file} (a {manifest['world_size']}-worker set; "
            f"the file is left from a {world}-worker save): pass the set's plain name {base_of(path)}.pt"
        )


def _raise_no_manifest(manifest, rank_files):
    meta = peek_metadata(sorted(rank_files)[0])
    named = f" (the first is {describe_part(meta, sorted(rank_files)[0])})" if meta else ""
    raise CheckpointSetError(
        f"{len(rank_files)} rank files{named} but no manifest {manifest}: the save did not finish, or the files were "
        f"copied out of their set (copy the set's other rank files and its manifest beside them)"
    )


def remove_other_layouts(base: str, parallel_size: int) -> None:
    """After ``base`` was saved as ``parallel_size`` (P) rank files, drop what an earlier run with another
    world size left under the same name, so the directory never holds two layouts for one name."""
    # A 1-worker save writes the single file, never rank files: a 1-of-1 set (``reshard
    # --world-size 1``) it resumed from is another layout too. The manifest goes first, so a crash
    # in between leaves unlisted rank files, never a manifest listing a missing file.
    stale = [manifest_path(base)] if parallel_size == 1 and os.path.exists(manifest_path(base)) else []
    stale += [
        f
        for f in glob.glob(glob.escape(base) + "-rank-*-of-*.pt")
        if parallel_size == 1 or split_rank_suffix(f)[2] != parallel_size
    ]
    if parallel_size > 1 and os.path.isfile(base + ".pt"):
        stale.append(base + ".pt")
    for path in stale:
        logger.info(f"removing {path}: superseded by the new {parallel_size}-worker save of {os.path.basename(base)}")
        os.remove(path)
