"""The set id of a save in fairseq-train: what every worker writes into its rank file and rank 0
into the manifest, agreed on without a collective.

Each worker derives it from values all workers of one launch already share: the update number
and world size, the seed and save dir (the same cfg everywhere), and the launch's rendezvous
(fairseq's init method, torchrun's MASTER_ADDR / MASTER_PORT / TORCHELASTIC_RUN_ID). A random id
would need a broadcast at start-up; a digest of the weights would need every worker to hash
the shared parameters at each save. The id tells one save from another (two runs in one dir,
a resumed run re-saving an update); that two files hold the same bytes is the manifest's sha256.
"""

import os

from .checkpoint import derive_set_id

LAUNCH_ENVIRONMENT = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def save_set_id(trainer, world_size: int) -> str:
    cfg = trainer.cfg
    launch = [
        getattr(cfg.common, "seed", None),
        os.path.abspath(getattr(cfg.checkpoint, "save_dir", None) or "."),
        getattr(cfg.distributed_training, "distributed_init_method", None),
        *(os.environ.get(name) for name in LAUNCH_ENVIRONMENT),
    ]
    return derive_set_id(trainer.get_num_updates(), world_size, launch)
