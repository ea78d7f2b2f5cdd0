"""The ``.prev`` generation: a save keeps the sets it is about to overwrite as ``<name>.prev``
(hard links, or copies where the filesystem has none) until it is complete, so a crash part-way
through a save leaves a complete set to resume from.
"""

import glob
import logging
import os
from typing import Dict, List, Optional

from .errors import CheckpointSetError
from .foreign import readable_manifest
from .keep_copy import keep_as
from .manifest import read_manifest, validate_set, write_manifest
from .names import MANIFEST_SUFFIX, PREVIOUS, base_of, manifest_path, rank_file

logger = logging.getLogger(__name__)


def current_manifests(directory: str) -> List[str]:
    return [
        p
        for p in glob.glob(os.path.join(glob.escape(directory), "*" + MANIFEST_SUFFIX))
        if not base_of(p).endswith(PREVIOUS)
    ]


def sets_to_protect(directory: str) -> List[str]:
    """The manifests of the sets a save must keep as ``.prev`` before it may overwrite their files:
    every current set, except one whose ``.prev`` (left by a crashed save) is the intact generation
    while the set itself is damaged; relinking would replace the good copy with the damaged one."""
    chosen = []
    for manifest in current_manifests(directory):
        if readable_manifest(manifest) is None:
            continue  # not ours: nothing of it to protect, and never touched
        previous = manifest_path(base_of(manifest) + PREVIOUS)
        if os.path.exists(previous):
            try:
                validate_set(manifest)
            except CheckpointSetError as e:
                logger.warning(f"keeping {previous} from an interrupted save: {e}")
                continue
        chosen.append(manifest)
    return chosen


def link_previous_generation(manifest_file: str, rank: int, parallel_size: int) -> None:
    """Keep this worker's files of set ``B`` as ``B.prev`` while a new save overwrites ``B``'s files
    (the new files are renamed into place, so the links keep the old contents; where the filesystem
    has no hard links, copies do)."""
    manifest = _same_world_manifest(manifest_file, parallel_size)
    if manifest is None:
        return
    directory = os.path.dirname(manifest_file)
    for entry in manifest["files"]:
        if entry["rank"] != rank:
            continue
        source = os.path.join(directory, entry["name"])
        target = rank_file(base_of(manifest_file) + PREVIOUS, rank, parallel_size)
        if os.path.exists(source):
            if os.path.exists(target) and os.path.samefile(source, target):
                continue  # already linked (rename would do nothing for two links of one file)
            # link (or copy) then rename: a stale ``.prev`` manifest from a crashed save never lists a missing file
            keep_as(source, target)


def write_previous_manifest(manifest_file: str, parallel_size: int) -> None:
    """The manifest of ``B.prev``, once every worker has linked its files."""
    manifest = _same_world_manifest(manifest_file, parallel_size)
    if manifest is None:
        return
    previous_base = base_of(manifest_file) + PREVIOUS
    files = [
        dict(e, name=os.path.basename(rank_file(previous_base, e["rank"], parallel_size))) for e in manifest["files"]
    ]
    write_manifest(
        previous_base,
        parallel_size,
        manifest["num_updates"],
        files,
        manifest["num_experts"],
        manifest.get("set_id"),
        manifest.get("workers"),
        manifest.get("replicas"),
    )


def _same_world_manifest(manifest_file: str, parallel_size: int) -> Optional[Dict]:
    try:
        manifest = read_manifest(manifest_file)
    except CheckpointSetError:
        return None
    return manifest if manifest["world_size"] == parallel_size else None


def remove_previous_generations(directory: str) -> None:
    """Once a save is complete, the ``.prev`` generations it protected are no longer needed."""
    for manifest in glob.glob(os.path.join(glob.escape(directory), "*" + PREVIOUS + MANIFEST_SUFFIX)):
        if readable_manifest(manifest) is not None:  # another tool's file of that name stays
            os.remove(manifest)
    for pattern in ("*" + PREVIOUS + "-rank-*-of-*.pt", "*" + PREVIOUS + "-rank-*-of-*.pt.tmp"):
        for path in glob.glob(os.path.join(glob.escape(directory), pattern)):
            os.remove(path)
