#!/usr/bin/env python
"""fairseq-train with a planted fault, for the CPU dry run's proof that the one-shot's verdicts decide
(``ONESHOT_PLANT=run=fault,...``, dry run only): a verdict that a wrong run passes would pass it on the GPU too.

Usage: python oneshot_plant.py FAULT <fairseq-train arguments>, FAULT one of
* ``wrong_scale``: every gradient doubled before the norm and the clipping, as a gradient summed over two
  workers and never averaged would be; Adam scales it away, so the loss still falls;
* ``crash``: the first training step raises a ValueError naming a flag, which is not the plugin's refusal.
"""

import sys

FAULTS = ("wrong_scale", "crash")


def plant(fault):
    from fairseq import trainer

    if fault == "wrong_scale":
        clip_grad_norm = trainer.Trainer.clip_grad_norm

        def doubled(self, clip_norm):
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(2)
            return clip_grad_norm(self, clip_norm)

        trainer.Trainer.clip_grad_norm = doubled
    elif fault == "crash":

        def crash(self, samples, raise_oom=False):
            raise ValueError("--ddp-backend planted crash: a ValueError naming a flag is a crash, not a refusal")

        trainer.Trainer.train_step = crash
    else:
        raise SystemExit(f"oneshot_plant.py: unknown fault {fault!r}: use one of {', '.join(FAULTS)}")


if __name__ == "__main__":
    from fairseq_cli import train  # first: importing it sets up fairseq-train's log format

    plant(sys.argv[1])
    sys.argv = ["fairseq-train", *sys.argv[2:]]
    train.cli_main()
