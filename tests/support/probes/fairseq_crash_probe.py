"""fairseq-train in which one worker is SIGKILLed at a chosen point (no cleanup, like a lost node).

Usage (under torchrun): CRASH_PLAN=RANK:UPDATE:PHASE[:N] python tests/support/probes/fairseq_crash_probe.py <fairseq-train args>

The kill happens on worker RANK while it produces update UPDATE (or saves it), at PHASE:
  all_to_all:N  at the N-th MoE all-to-all of the step (0-based; forward and backward both count),
                so the peers are left waiting inside an exchange
  optimizer     inside the optimizer step, after gradients were all-reduced
  save:N        in the save after that update, once this worker wrote N checkpoint files (N=0:
                before any; a large N: after its files, before the save returns)
  stall:N       not a kill: the worker sleeps N seconds before the step, alive but stuck
  external      never from inside: with CRASH_PID_DIR set, every worker writes its pid there (and,
                before each step, the number of updates done) so that the test can SIGKILL it
                from outside at a time of its choosing; worker RANK lingers LINGER_S seconds after
                producing UPDATE, so a kill sent within that much of the step's start lands while
                UPDATE is produced, before its save (a fast step would otherwise let the job run
                on, and save updates that the next trial of a chain means to kill)
Without CRASH_PLAN it is plain fairseq-train. The other workers are then stopped by torchrun, as
in a real crash.

With CRASH_PID_DIR set, every worker also watches its own checkpoint file operations and appends to
``order-violations-rank-R`` there each one that opens a window in which a kill would lose a set:
removing a file that a manifest still lists (the set would list a missing file for good), or
replacing a file of a set whose ``.prev`` generation is not complete on disk (neither generation
would be complete).
"""

import os
import signal
import sys

LINGER_S = 2.0  # longer than the test's largest delay (0.4 s) plus its polling and scheduling lag


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    from fairseq.optim.fairseq_optimizer import FairseqOptimizer
    from fairseq.trainer import Trainer
    from fairseq_cli import train

    from fairseq import checkpoint_utils
    from fairseq_moe_ext.moe import comm
    from full_precision_logs import log_every_digit

    log_every_digit()  # the tests compare logged losses exactly (after fairseq_cli.train set up logging)

    rank = int(os.environ.get("RANK", 0))
    report_dir = os.environ.get("CRASH_PID_DIR")
    if report_dir:
        with open(os.path.join(report_dir, f"pid-rank-{rank}"), "w") as f:
            f.write(str(os.getpid()))
        watch_checkpoint_file_order(os.path.join(report_dir, f"order-violations-rank-{rank}"))
    plan = os.environ.get("CRASH_PLAN", "").split(":")
    mine = len(plan) >= 3 and int(plan[0]) == rank
    update, phase, n = (int(plan[1]), plan[2], int(plan[3]) if len(plan) > 3 else 0) if mine else (-1, "", 0)
    step = {"trainer": None}

    def producing_the_update():
        trainer = step["trainer"]
        return trainer is not None and trainer.get_num_updates() == update - 1

    original_train_step = Trainer.train_step

    def train_step(self, *args, **kwargs):
        step["trainer"], step["collectives"] = self, 0
        if report_dir:  # the updates done so far, for a test that kills from outside
            # Written aside and renamed: the test polls this file and must never read it half-written.
            progress = os.path.join(report_dir, f"updates-rank-{rank}")
            with open(progress + ".tmp", "w") as f:
                f.write(str(self.get_num_updates()))
            os.replace(progress + ".tmp", progress)
        return original_train_step(self, *args, **kwargs)

    Trainer.train_step = train_step
    if not mine:
        return run_fairseq_train(train)

    if phase == "all_to_all":
        real_all_to_all = comm._all_to_all

        def all_to_all(*args):
            if producing_the_update():
                if step["collectives"] == n:
                    die()
                step["collectives"] += 1
            return real_all_to_all(*args)

        comm._all_to_all = all_to_all
    elif phase == "optimizer":
        real_step = FairseqOptimizer.step

        def optimizer_step(self, *args, **kwargs):
            if producing_the_update():
                die()
            return real_step(self, *args, **kwargs)

        FairseqOptimizer.step = optimizer_step
    elif phase == "save":
        original_save = checkpoint_utils.save_checkpoint

        def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
            if trainer.get_num_updates() != update:
                return original_save(cfg, trainer, epoch_itr, val_loss)
            written = [0]
            real_save, real_replace = checkpoint_utils.torch_persistent_save, os.replace

            def count_then_maybe_die():
                if written[0] >= n:
                    die()
                written[0] += 1

            def torch_persistent_save(*args, **kwargs):
                count_then_maybe_die()
                return real_save(*args, **kwargs)

            def replace(src, dst):
                if dst.endswith(".pt") and ".prev-rank-" not in dst:  # .prev links are not the save's files
                    count_then_maybe_die()
                return real_replace(src, dst)

            checkpoint_utils.torch_persistent_save = torch_persistent_save
            os.replace = replace
            original_save(cfg, trainer, epoch_itr, val_loss)
            die()  # the save wrote fewer files than N: die before it returns anyway

        checkpoint_utils.save_checkpoint = save_checkpoint
    elif phase == "stall":
        import time

        stalling_train_step = Trainer.train_step

        def stalled_train_step(self, *args, **kwargs):
            if self.get_num_updates() == update - 1:
                time.sleep(n)
            return stalling_train_step(self, *args, **kwargs)

        Trainer.train_step = stalled_train_step
    elif phase == "external":
        import time

        lingering_train_step = Trainer.train_step

        def train_step_then_linger(self, *args, **kwargs):
            producing = self.get_num_updates() == update - 1
            result = lingering_train_step(self, *args, **kwargs)
            if producing:
                time.sleep(LINGER_S)
            return result

        Trainer.train_step = train_step_then_linger
    else:
        raise SystemExit(f"unknown CRASH_PLAN phase {phase!r}")
    run_fairseq_train(train)


def watch_checkpoint_file_order(violations_file):
    import glob
    import json

    def listed_files(manifest):
        """The manifest's file entries, or None while it is missing or being written."""
        try:
            with open(manifest) as f:
                return json.load(f)["files"]
        except (OSError, ValueError):
            return None

    def manifests_listing(path):
        directory, name = os.path.split(os.fspath(path))
        for manifest in glob.glob(os.path.join(glob.escape(directory or "."), "*.set.json")):
            if name in {entry["name"] for entry in listed_files(manifest) or []}:
                yield manifest

    def complete_on_disk(manifest):
        files = listed_files(manifest)
        if files is None:
            return False
        directory = os.path.dirname(manifest)
        return all(
            os.path.isfile(os.path.join(directory, e["name"]))
            and os.path.getsize(os.path.join(directory, e["name"])) == e["bytes"]
            for e in files
        )

    def report(message):
        with open(violations_file, "a") as f:
            f.write(message + "\n")

    real_remove, real_replace, real_rename = os.remove, os.replace, os.rename

    def remove(path, *args, **kwargs):
        if os.fspath(path).endswith(".pt"):
            for manifest in manifests_listing(path):
                report(f"removed {os.path.basename(path)} while {os.path.basename(manifest)} listed it")
        return real_remove(path, *args, **kwargs)

    def check_overwrite(dst):
        if os.fspath(dst).endswith(".pt") and ".prev-rank-" not in os.fspath(dst):
            for manifest in manifests_listing(dst):
                if manifest.endswith(".prev.set.json"):
                    continue
                previous = manifest[: -len(".set.json")] + ".prev.set.json"
                if not complete_on_disk(previous):
                    report(
                        f"replaced {os.path.basename(dst)} of {os.path.basename(manifest)} with no complete "
                        f"{os.path.basename(previous)} on disk"
                    )

    def replace(src, dst, *args, **kwargs):
        check_overwrite(dst)
        return real_replace(src, dst, *args, **kwargs)

    def rename(src, dst, *args, **kwargs):
        check_overwrite(dst)
        return real_rename(src, dst, *args, **kwargs)

    os.remove, os.replace, os.rename = remove, replace, rename


def run_fairseq_train(train):
    sys.argv = ["fairseq-train"] + sys.argv[1:]
    train.cli_main()


if __name__ == "__main__":
    main()
