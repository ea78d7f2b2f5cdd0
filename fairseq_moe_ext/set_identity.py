"""The set id of a save in fairseq-train: what every worker writes into its rank file and rank 0
into the manifest, agreed on without a collective.

Each worker derives it from values all workers of one launch already share: the update number
and world size, the seed and save dir (the same cfg everywhere), and the launch's rendezvous
(fairseq's init method, torchrun's MASTER_ADDR / MASTER_PORT / TORCHELASTIC_RUN_ID). A random id
would need a broadcast at start-up; a digest of the weights would need every worker to hash
the shared parameters at each save. The id tells one save from another (two runs in one dir,
a resumed run re-saving an update); that two files hold the same bytes is the manifest's sha256.
"""

import logging
import os
from typing import Dict, List, Optional

from .checkpoint import derive_set_id

logger = logging.getLogger(__name__)

LAUNCH_ENVIRONMENT = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def save_set_id(trainer, world_size: int) -> str:
    cfg = trainer.cfg
    launch = [
        getattr(cfg.common, "seed", None),
        getattr(cfg.checkpoint, "save_dir", None),  # as typed, the same on every worker (abspath depends on the cwd)
        getattr(cfg.distributed_training, "distributed_init_method", None),
        *(os.environ.get(name) for name in LAUNCH_ENVIRONMENT),
    ]
    return derive_set_id(trainer.get_num_updates(), world_size, launch)


def agreed_set_id(base: str, entries: List[Dict]) -> Optional[str]:
    """The set id for the manifest of ``base``, from the workers' reports of the files they wrote
    (each carries the id its worker put into the file; popped here, the manifest stores it once).
    Workers that derived different ids (a launch whose environment differs between nodes) get a
    manifest without an id, so the set still loads, only without that cross-check, and a warning."""
    ids = {entry.pop("set_id", None) for entry in entries}
    if len(ids) == 1:
        return ids.pop()
    logger.warning(f"checkpoint {base}: the workers derived different set ids ({sorted(map(str, ids))}); the manifest "
                   f"records none, so the set loads without the set-id check (the launch environment differs "
                   f"between workers: {', '.join(LAUNCH_ENVIRONMENT)})")
    return None
