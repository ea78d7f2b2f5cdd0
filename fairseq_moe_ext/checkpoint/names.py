"""How the files of a checkpoint are named on disk.

``d/checkpoint_last.pt`` (fairseq's name) stands for a single file of that name or for a set:
``d/checkpoint_last-rank-R-of-W.pt`` for each rank and the manifest ``d/checkpoint_last.set.json``.
A set's previous generation, kept while a save overwrites it, is the set named ``checkpoint_last.prev``.
"""

import re

MANIFEST_SUFFIX = ".set.json"
RANK_SUFFIX_RE = re.compile(r"-rank-(\d+)-of-(\d+)$")
PREVIOUS = ".prev"


def rank_suffix(rank: int, world_size: int) -> str:
    return f"-rank-{rank}-of-{world_size}"


def split_rank_suffix(path: str):
    """``d/checkpoint_last-rank-1-of-4.pt`` -> (``d/checkpoint_last``, 1, 4); no suffix -> rank None."""
    stem = path[:-3] if path.endswith(".pt") else path
    match = RANK_SUFFIX_RE.search(stem)
    if not match:
        return stem, None, None
    return stem[: match.start()], int(match.group(1)), int(match.group(2))


def base_of(path: str) -> str:
    """The checkpoint's name without rank suffix or extension: ``d/checkpoint_last``."""
    if path.endswith(MANIFEST_SUFFIX):
        return path[: -len(MANIFEST_SUFFIX)]
    return split_rank_suffix(path)[0]


def manifest_path(base: str) -> str:
    return base + MANIFEST_SUFFIX


def rank_file(base: str, rank: int, world_size: int) -> str:
    return f"{base}{rank_suffix(rank, world_size)}.pt"
