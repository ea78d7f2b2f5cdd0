"""The set id of a save: derived by every worker alone, agreed on in the manifest.

The id names one save: every worker derives it from what all workers of one launch already share
(the update number, the world size and the launch: seed, save dir, rendezvous address and run id),
so no collective is needed and every copy fairseq makes of the save (checkpoint_last,
checkpoint_best, checkpointN) carries the same id. A random id would need a broadcast at start-up; a
digest of the weights would need every worker to hash the shared parameters at each save. It tells
saves apart (two runs in one dir, a resumed run re-saving an update), not contents: that two files
hold the same bytes is the manifest's sha256. ``training/set_identity.py`` gathers the launch values
from fairseq-train's config.
"""

import hashlib
import json
import logging
from typing import Dict, List, Optional, Sequence

logger = logging.getLogger(__name__)

# The launcher's rendezvous variables (torchrun's), part of every worker's launch values.
LAUNCH_ENVIRONMENT = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def derive_set_id(num_updates: int, world_size: int, launch: Sequence) -> str:
    """16 hex digits naming one save; ``launch``: JSON-able values every worker of the run shares."""
    text = json.dumps([num_updates, world_size, [str(x) for x in launch]])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def agreed_set_id(base: str, entries: List[Dict]) -> Optional[str]:
    """The set id for the manifest of ``base``, from the workers' reports of the files they wrote
    (each carries the id its worker put into the file; popped here, the manifest stores it once).
    Workers that derived different ids (a launch whose environment differs between nodes) get a
    manifest without an id, so the set still loads, only without that cross-check, and a warning."""
    ids = {entry.pop("set_id", None) for entry in entries}
    if len(ids) == 1:
        return ids.pop()
    logger.warning(
        f"checkpoint {base}: the workers derived different set ids ({sorted(map(str, ids))}); the manifest "
        f"records none, so the set loads without the set-id check (the launch environment differs "
        f"between workers: {', '.join(LAUNCH_ENVIRONMENT)})"
    )
    return None
