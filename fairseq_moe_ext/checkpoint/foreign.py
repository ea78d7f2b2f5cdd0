"""Manifests found by scanning a save dir, where not every ``*.set.json`` is ours.

A save dir may hold another tool's ``*.set.json``, a hand-written one, or a damaged one. Whatever
scans the directory (the resume fallback, the save hook choosing which sets to keep as ``.prev``,
the clean-up after a save) ignores such a file, leaves it untouched, and says so once: a run saves
at every interval, and one warning per save would bury the log.
"""

import logging
from typing import Dict, Optional

from .errors import CheckpointSetError
from .manifest import read_manifest

logger = logging.getLogger(__name__)

# Process-wide on purpose: the promise is one warning per file per process, across every save.
_WARNED_ABOUT = set()


def warn_once(path: str, problem: str) -> None:
    if path in _WARNED_ABOUT:
        return
    _WARNED_ABOUT.add(path)
    logger.warning(f"ignoring {path}: {problem} (the file is left as it is; this warning is not repeated)")


def readable_manifest(path: str) -> Optional[Dict]:
    """The manifest at ``path`` if it is a well-formed one of ours, else None (warned once)."""
    try:
        return read_manifest(path)
    except CheckpointSetError as e:
        warn_once(path, str(e))
        return None
