"""fairseq-train that dies (os._exit, like SIGKILL: no cleanup) on one worker in the middle of a save.

Usage (under torchrun): CRASH_RANK=r CRASH_AT_UPDATE=u CRASH_AFTER_FILES=n python tests/fairseq_crash_probe.py <fairseq-train args>
Worker r exits right after writing its n-th checkpoint file (n=0: before writing any) of the save at
update u. The other workers are then stopped by torchrun, as in a real crash.
"""

import os
import sys


def main():
    from fairseq import checkpoint_utils
    from fairseq_cli import train

    rank = int(os.environ["RANK"])
    crash_rank = int(os.environ["CRASH_RANK"])
    crash_update = int(os.environ["CRASH_AT_UPDATE"])
    crash_after = int(os.environ["CRASH_AFTER_FILES"])
    original_save = checkpoint_utils.save_checkpoint

    def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
        if rank != crash_rank or trainer.get_num_updates() != crash_update:
            return original_save(cfg, trainer, epoch_itr, val_loss)
        written = [0]
        real_save, real_replace = checkpoint_utils.torch_persistent_save, os.replace

        def count_then_maybe_die():
            if written[0] >= crash_after:
                os._exit(9)
            written[0] += 1

        def torch_persistent_save(*args, **kwargs):
            count_then_maybe_die()
            return real_save(*args, **kwargs)

        def replace(src, dst):
            if dst.endswith(".pt"):
                count_then_maybe_die()
            return real_replace(src, dst)

        checkpoint_utils.torch_persistent_save = torch_persistent_save
        os.replace = replace
        original_save(cfg, trainer, epoch_itr, val_loss)
        os._exit(9)  # the save wrote fewer files than asked: die before its manifest anyway

    checkpoint_utils.save_checkpoint = save_checkpoint
    sys.argv = ["fairseq-train"] + sys.argv[1:]
    train.cli_main()


if __name__ == "__main__":
    main()
