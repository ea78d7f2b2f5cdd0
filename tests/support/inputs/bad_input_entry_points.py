"""The tools and inputs of the bad-input catalogue's rows for every fairseq entry point
(tests/cli/test_bad_input_entry_points.py): validate, eval-lm, interactive, hydra-train, and generate
under torchrun, beside train and generate (bad_input_runner.py). Each refusal exits with status 2."""

from pathlib import Path
from typing import Callable

from support.inputs.bad_input_makers import generate_from
from support.inputs.untrusted_pickles import MARKER, plant, plant_in_set
from support.launch.bad_input_runner import BIN, Make, copy_of, train_args
from support.launch.fairseq_helpers import CONFIG_DIR, USER_DIR, run_fairseq, torchrun
from support.launch.paths import PROBES

MISSING_RANK_1 = "checkpoint_last-rank-1-of-2.pt"
# Runs a fairseq entry point on a torch without torch._grouped_mm, the expert matmul asked for by name.
SETUP_PROBE = PROBES / "fairseq_setup_refusal_probe.py"


def refused_by(tool: str) -> Callable:
    """``fairseq_cli.<tool>`` expected to exit with status 2."""
    return lambda args: run_fairseq(tool, *args, expect_failure=True, expect_status=2)


def refused_at_setup(tool: str) -> Callable:
    """``fairseq_cli.<tool>`` refusing a set-up (the probe: a torch without ``torch._grouped_mm``), status 2."""
    return lambda args: run_fairseq(tool, *args, expect_failure=True, expect_status=2, probe=SETUP_PROBE)


def two_workers_refused_at_setup(args):
    return torchrun(2, SETUP_PROBE, ["train", "--ddp-backend", "legacy_ddp", *args], expect_failure=True)


def generate_on_two_workers(args):
    return torchrun(2, BIN / "fairseq-generate", args, expect_failure=True)


def a_set_missing_rank_1(*flags, task: str = "translation") -> Make:
    """``--path`` to a copy of the 2-worker set that lost rank 1's file (which must not change)."""

    def make(inputs, work):
        directory = copy_of(inputs.set, work)
        (directory / MISSING_RANK_1).unlink()
        path = str(directory / "checkpoint_last.pt")
        args = [str(inputs.data), "--user-dir", USER_DIR, "--cpu", "--path", path, "--task", task, *flags]
        return args, [directory]

    return make


def the_single_checkpoint(*flags) -> Make:
    """``--path`` to a copy of the 1-process run's checkpoint (which must not change)."""

    def make(inputs, work):
        directory = copy_of(inputs.single, work)
        path = str(directory / "checkpoint_last.pt")
        return [str(inputs.data), "--user-dir", USER_DIR, "--cpu", "--path", path, "--task", "translation", *flags], [
            directory
        ]

    return make


def generating_from_a_set_missing_rank_1() -> Make:
    return generate_from("set", lambda d: (d / MISSING_RANK_1).unlink())


def hydra_training(*overrides: str) -> Make:
    """fairseq-hydra-train of the packaged moe_lm_tiny config into a new save dir (which must stay absent),
    hydra's own files in the case's work dir."""

    def make(inputs, work):
        save_dir = work / "ck"
        args = ["--config-dir", CONFIG_DIR, "--config-name", "moe_lm_tiny", f"common.user_dir={USER_DIR}",
                f"task.data={inputs.lm_data}", f"checkpoint.save_dir={save_dir}", f"hydra.run.dir={work / 'hydra'}",
                "optimization.max_update=2", *overrides]  # fmt: skip
        return args, [save_dir]

    make.needs_checkpoints = False
    return make


# ---------------------------------------------------------------- a pickle that would run a shell command


def forge_rank_1(directory: Path) -> None:
    """Rank 1's file of the set in ``directory`` pickles ``touch <directory>/code_ran`` (its manifest entry
    updated to match): were it unpickled, a file would appear in the watched directory."""
    plant_in_set(directory, MISSING_RANK_1, directory / MARKER)


def upcycling_from_a_forged_dense_checkpoint() -> Make:
    """fairseq-train --moe-upcycle-from a copy of the dense checkpoint that pickles ``touch <copy>/code_ran``."""

    def make(inputs, work):
        dense = copy_of(inputs.dense, work, "dense")
        plant(dense / "checkpoint_last.pt", dense / MARKER)
        save_dir = work / "ck"
        upcycle = ["--moe-normalize-gate", "--moe-upcycle-from", str(dense / "checkpoint_last.pt")]
        return train_args(inputs.data, save_dir, "--max-update", "2", *upcycle), [save_dir, dense]

    return make
