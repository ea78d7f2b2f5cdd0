"""The set id of a save in fairseq-train: what every worker writes into its rank file and rank 0
into the manifest, agreed on without a collective (``checkpoint/set_id.py`` says why).

Each worker derives it from values all workers of one launch already share: the update number
and world size, the seed and save dir (the same cfg everywhere), and the launch's rendezvous
(fairseq's init method, torchrun's MASTER_ADDR / MASTER_PORT / TORCHELASTIC_RUN_ID).
"""

import os

from ..checkpoint.set_id import LAUNCH_ENVIRONMENT, derive_set_id
from ..common.config_value import config_value


def save_set_id(trainer, world_size: int) -> str:
    cfg = trainer.cfg
    launch = [
        config_value(cfg.common, "seed"),
        config_value(cfg.checkpoint, "save_dir"),  # as typed, the same on every worker (abspath depends on the cwd)
        config_value(cfg.distributed_training, "distributed_init_method"),
        *(os.environ.get(name) for name in LAUNCH_ENVIRONMENT),
    ]
    return derive_set_id(trainer.get_num_updates(), world_size, launch)
