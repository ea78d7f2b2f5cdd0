"""The bad-input catalogue's runner (tests/cli/test_bad_input*.py): the inputs every case is made
from, the command-line tools each case expects to fail, the ``Case`` row, and the check of one run:
it failed (a fairseq tool with status 2), no traceback anywhere in its output, its last error line names the
problem and the fix, and no watched directory changed.
The fixtures that start the runs are tests/cli/conftest.py's; what each case runs on is
bad_input_makers.py.
"""

import glob
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch

from fairseq_moe_ext import checkpoint as moe_ckpt
from support.launch.fairseq_helpers import USER_DIR, run_checkpoint_tool, run_fairseq, tail, torchrun
from support.launch.paths import PROBES, REPO_ROOT

BIN = Path(sys.executable).parent
SET = moe_ckpt.CheckpointSetError.__module__ + ".CheckpointSetError"
DAMAGED = moe_ckpt.DamagedCheckpointError.__module__ + ".DamagedCheckpointError"
UNSAFE = moe_ckpt.UnsafeCheckpointError.__module__ + ".UnsafeCheckpointError"
NOT_A_CHECKPOINT = moe_ckpt.NotACheckpointError.__module__ + ".NotACheckpointError"
# How each tool's refusals start (common.refusal.MoERefusal, and argparse's own): "prog: error", prog being
# argparse's (the script's file name; the console script's under torchrun).
TRAIN, GENERATE, LAUNCHED_TRAIN = "train.py: error", "generate.py: error", "fairseq-train: error"
OOM_PROBE = "fairseq_out_of_memory_probe.py: error"


# ---------------------------------------------------------------- inputs


# fmt: off
@dataclass
class Inputs:
    data: Path  # the translation corpus, binarized
    lm_data: Path  # a language-model corpus, binarized
    single: Optional[Path] = None  # save dir of a 1-process run: checkpoint_last.pt / checkpoint_best.pt (4 experts)
    set: Optional[Path] = None  # the same checkpoint as a 2-worker set: checkpoint_last-rank-{0,1}-of-2.pt + manifest
    other_set: Optional[Path] = None  # "another run's" set: the same model with other expert weights
    dense: Optional[Path] = None  # save dir of a dense `transformer` of moe_transformer_tiny's shape (1 update)
# fmt: on


def train_args(data, save_dir, *extra, arch="moe_transformer_tiny", criterion="moe_label_smoothed_cross_entropy"):
    return [
        str(data),
        "--user-dir",
        USER_DIR,
        "--cpu",
        "--arch",
        arch,
        "--num-workers",
        "0",
        "--criterion",
        criterion,
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--max-tokens",
        "500",
        "--save-dir",
        str(save_dir),
        *extra,
    ]


# moe_transformer_tiny's shape, for the dense model that is upcycled into it
# fmt: off
TINY_SHAPE = ["--encoder-layers", "2", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
              "--encoder-attention-heads", "4", "--decoder-layers", "2", "--decoder-embed-dim", "64",
              "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "4"]
# fmt: on


def train_checkpoints(inputs: Inputs, root: Path) -> Inputs:
    """A 3-update 1-process run; its checkpoint as a 2-worker set, and the set of "another run" (the
    same model with other expert weights), written by the checkpoint tool's own code (the format
    2-worker training writes; tests/cli/test_multiworker_cli.py covers sets written by training); and a
    1-update dense transformer of the same shape, to upcycle."""
    run_fairseq("train", *train_args(inputs.data, root / "run", "--max-update", "3"))
    full = moe_ckpt.load_full(str(root / "run" / "checkpoint_last.pt"))
    other = dict(full, model=dict(full["model"]))
    noise = torch.Generator().manual_seed(2)
    for key in full["moe"]["expert_keys"]:
        other["model"][key] = full["model"][key] + 0.01 * torch.randn(full["model"][key].shape, generator=noise)
    for name, state in (("set", full), ("other_set", other)):
        (root / name).mkdir()
        moe_ckpt.save_set(state, str(root / name / "checkpoint_last"), 2)
    run_fairseq(
        "train",
        *train_args(
            inputs.data,
            root / "dense",
            "--max-update",
            "1",
            *TINY_SHAPE,
            arch="transformer",
            criterion="label_smoothed_cross_entropy",
        ),
    )
    return Inputs(
        inputs.data,
        inputs.lm_data,
        single=root / "run",
        set=root / "set",
        other_set=root / "other_set",
        dense=root / "dense",
    )


def copy_of(source: Path, work: Path, name="ck") -> Path:
    target = work / name
    shutil.copytree(source, target)
    return target


def fingerprint(directory: Path) -> Dict[str, str]:
    """sha256 of every file under ``directory`` (none if it does not exist)."""
    if not directory.exists():
        return {}
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------- the tools, each expected to fail


def fairseq_train(args):  # a refusal exits with argparse's status 2, as a refused flag does
    return run_fairseq("train", *args, expect_failure=True, expect_status=2)


def fairseq_generate(args):
    return run_fairseq("generate", *args, expect_failure=True, expect_status=2)


def two_workers(args):
    # --ddp-backend first: a case's own --ddp-backend comes later and wins.
    return torchrun(2, BIN / "fairseq-train", ["--ddp-backend", "legacy_ddp", *args], expect_failure=True)


def two_workers_one_running_out_of_memory(args):
    """Rank 1's own output: its experts run out of device memory in the first step (the probe); rank
    0 stops with the same line, relayed (tests/fairseq/test_out_of_memory.py checks both)."""
    probe = PROBES / "fairseq_out_of_memory_probe.py"
    with tempfile.TemporaryDirectory() as logs:
        torchrun(2, probe, ["--ddp-backend", "legacy_ddp", *args], expect_failure=True, log_dir=logs, redirects=3)
        found = {Path(p).name: Path(p).read_text() for p in glob.glob(f"{logs}/**/1/std*.log", recursive=True)}
        return found.get("stdout.log", "") + found.get("stderr.log", "")  # the traceback last


def two_workers_without_world_size(args):
    return torchrun(
        2, BIN / "fairseq-train", ["--ddp-backend", "legacy_ddp", *args], expect_failure=True, world_size_flag=False
    )


def plan_tool(args):
    """``python -m fairseq_moe_ext plan <args>``, expected to fail with argparse's status 2; its output, stderr last."""
    done = subprocess.run(
        [sys.executable, "-m", "fairseq_moe_ext", "plan", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=str(REPO_ROOT),
    )
    if done.returncode != 2:
        pytest.fail(
            f"expected plan {' '.join(map(str, args))} to fail with status 2, got {done.returncode}:\n"
            f"{tail(done.stdout + done.stderr)}",
            pytrace=False,
        )
    return done.stdout + done.stderr


def checkpoint_tool(args):
    """The checkpoint tool, expected to refuse with argparse's status 2."""
    done = run_checkpoint_tool(*args, combined=True, timeout=150)
    if done.returncode != 2:
        pytest.fail(f"expected {' '.join(done.args)} to fail with status 2, got {done.returncode}:\n{tail(done.stdout)}",
                    pytrace=False)  # fmt: skip
    return done.stdout


# ---------------------------------------------------------------- a row of the catalogue

Make = Callable[[Inputs, Path], Tuple[List[str], List[Path]]]  # -> (arguments, directories that must not change)


# fmt: off
@dataclass(frozen=True)
class Case:
    id: str
    tool: Callable[[List[str]], str]
    make: Make
    error: str  # how the last error line starts: "<prog>: error" (a fairseq tool), "error" (the checkpoint tool)
    problem: str  # substrings of that line naming the problem ...
    fix: str  # ... and the fix

    @property
    def needs_checkpoints(self) -> bool:
        return getattr(self.make, "needs_checkpoints", True)

    def __str__(self):
        return self.id
# fmt: on


# ---------------------------------------------------------------- checking one run

# A line that reports an error: "ValueError: ...", "pkg.mod.SomeError: ...", "prog: error: ...",
# "error: ..."; torchrun prefixes workers' lines with "[rankN]: ".
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?((?:[A-Za-z_][\w.]*(?:Error|Exception))|[\w.-]+: error|error): .*$")


LAUNCHER_ERRORS = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError",)


def last_error_line(output: str) -> Tuple[str, str]:
    """The last error line of the tool's own output (torchrun's summary left out), without the
    rank prefix, and the line that follows it."""
    lines = output.splitlines()
    found = [(i, m) for i, m in enumerate(map(ERROR_LINE.match, lines)) if m and m.group(1) not in LAUNCHER_ERRORS]
    assert found, f"no error line in:\n{tail(output, 60)}"
    i, match = found[-1]
    following = lines[i + 1] if i + 1 < len(lines) else ""
    return lines[i][match.start(1) :], following


@dataclass
class Started:
    future: Future
    watched: List[Path]
    before: Dict[Path, Dict[str, str]]


# Where Python prints a traceback (and chains one to another); torchrun's workers prefix "[rankN]: ".
TRACEBACK = re.compile(
    r"^(?:\[rank\d+\]: )?(?:Traceback \(most recent call last\):|During handling of the above exception|"
    r"The above exception was the direct cause|  File \"[^\"]+\", line \d+)"
)


def tracebacks(output: str) -> List[str]:
    """The tracebacks in the tool's output, each shown from its start, leaving out torchrun's own (the launcher
    raises ChildFailedError after a worker failed: docs/troubleshooting.md shows what remains of it)."""
    lines, found, i = output.splitlines(), [], 0
    while i < len(lines):
        if TRACEBACK.match(lines[i]):
            end = next((j for j in range(i, len(lines)) if ERROR_LINE.match(lines[j])), len(lines) - 1)
            match = ERROR_LINE.match(lines[end])
            if not (match and match.group(1) in LAUNCHER_ERRORS):
                found.append("\n".join(lines[i : end + 1]))
            i = end
        i += 1
    return found


def check_case(case: Case, run: Started) -> None:
    output = run.future.result()  # the tool's runner already failed the test if the tool succeeded or hung
    shown = tracebacks(output)
    assert not shown, "the refusal came with a traceback:\n" + "\n".join(shown)[-3000:]
    line, following = last_error_line(output)
    assert line.startswith(case.error + ": "), f"{line}\n{tail(output, 60)}"
    assert case.problem in line, line
    assert case.fix in line, line
    assert not following[:1].isspace(), f"the error goes on over several lines:\n{line}\n{following}"
    for directory in run.watched:
        assert fingerprint(directory) == run.before[directory], f"{directory} changed"
