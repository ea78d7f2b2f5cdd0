"""Bad input fails fast with one clear line naming the problem and the fix, and changes no file.

Every case runs a real command-line tool (fairseq-train, fairseq-generate, fairseq-train on two
torchrun workers, ``python -m fairseq_moe_ext.checkpoint``) on inputs made for it and checks that
the run fails, that its last error line names the problem and the fix, and that no file in the
directories it was given (save dir, checkpoint dir, output dir) changed, disappeared or appeared.

Each run spends most of its few seconds importing fairseq, and the runs do not depend on each
other, so they go two at a time (one per core) in the background as soon as their inputs exist;
each test then waits for its own run. ``-k`` selects cases as usual: only selected cases run.
"""

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch

from fairseq_helpers import (
    USER_DIR,
    fairseq_env,
    run_fairseq,
    tail,
    torchrun,
)
from fairseq_moe_ext import checkpoint as moe_ckpt

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
SET = moe_ckpt.CheckpointSetError.__module__ + ".CheckpointSetError"
DAMAGED = moe_ckpt.DamagedCheckpointError.__module__ + ".DamagedCheckpointError"
UNSAFE = moe_ckpt.UnsafeCheckpointError.__module__ + ".UnsafeCheckpointError"
NOT_A_CHECKPOINT = moe_ckpt.NotACheckpointError.__module__ + ".NotACheckpointError"


# ---------------------------------------------------------------- inputs

@dataclass
class Inputs:
    data: Path  # the translation corpus, binarized
    lm_data: Path  # a language-model corpus, binarized
    single: Optional[Path] = None  # save dir of a 1-process run: checkpoint_last.pt / checkpoint_best.pt (4 experts)
    set: Optional[Path] = None  # the same checkpoint as a 2-worker set: checkpoint_last-rank-{0,1}-of-2.pt + manifest
    other_set: Optional[Path] = None  # "another run's" set: the same model with other expert weights
    dense: Optional[Path] = None  # save dir of a dense `transformer` of moe_transformer_tiny's shape (1 update)


def train_args(data, save_dir, *extra, arch="moe_transformer_tiny", criterion="moe_label_smoothed_cross_entropy"):
    return [str(data), "--user-dir", USER_DIR, "--cpu", "--arch", arch, "--num-workers", "0",
            "--criterion", criterion, "--optimizer", "adam", "--lr", "1e-3",
            "--max-tokens", "500", "--save-dir", str(save_dir), *extra]


# moe_transformer_tiny's shape, for the dense model that is upcycled into it
TINY_SHAPE = ["--encoder-layers", "2", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
              "--encoder-attention-heads", "4", "--decoder-layers", "2", "--decoder-embed-dim", "64",
              "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "4"]


def train_checkpoints(inputs: Inputs, root: Path) -> Inputs:
    """A 3-update 1-process run; its checkpoint as a 2-worker set, and the set of "another run" (the
    same model with other expert weights), written by the checkpoint tool's own code (the format
    2-worker training writes; tests/test_multiworker_cli.py covers sets written by training); and a
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
    run_fairseq("train", *train_args(inputs.data, root / "dense", "--max-update", "1", *TINY_SHAPE, arch="transformer",
                                     criterion="label_smoothed_cross_entropy"))
    return Inputs(inputs.data, inputs.lm_data, single=root / "run", set=root / "set", other_set=root / "other_set",
                  dense=root / "dense")



def copy_of(source: Path, work: Path, name="ck") -> Path:
    target = work / name
    shutil.copytree(source, target)
    return target


def flip_bytes_in_the_middle(path: Path) -> None:
    """Corruption that keeps the size: 64 bytes inverted in the middle of the file (tensor data)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


class Smuggled:
    """Not among the types fairseq checkpoints store."""


def pickle_a_disallowed_type(path: Path) -> None:
    state = torch.load(path, weights_only=False)  # the test's own file: trusted here, and only here
    state["extra_state"]["smuggled"] = Smuggled()
    torch.save(state, path)


def fingerprint(directory: Path) -> Dict[str, str]:
    """sha256 of every file under ``directory`` (none if it does not exist)."""
    if not directory.exists():
        return {}
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- the tools, each expected to fail

def fairseq_train(args):
    return run_fairseq("train", *args, expect_failure=True)


def fairseq_generate(args):
    return run_fairseq("generate", *args, expect_failure=True)


def two_workers(args):
    # --ddp-backend first: a case's own --ddp-backend comes later and wins.
    return torchrun(2, BIN / "fairseq-train", ["--ddp-backend", "legacy_ddp", *args], expect_failure=True)


def two_workers_one_running_out_of_memory(args):
    """Rank 1's own output: its experts run out of device memory in the first step (the probe); rank
    0 stops with the same line, relayed (tests/test_out_of_memory.py checks both)."""
    probe = Path(__file__).parent / "fairseq_out_of_memory_probe.py"
    with tempfile.TemporaryDirectory() as logs:
        torchrun(2, probe, ["--ddp-backend", "legacy_ddp", *args], expect_failure=True, log_dir=logs, redirects=3)
        found = {Path(p).name: Path(p).read_text() for p in glob.glob(f"{logs}/**/1/std*.log", recursive=True)}
        return found.get("stdout.log", "") + found.get("stderr.log", "")  # the traceback last


def two_workers_without_world_size(args):
    return torchrun(2, BIN / "fairseq-train", ["--ddp-backend", "legacy_ddp", *args], expect_failure=True,
                    world_size_flag=False)


def checkpoint_tool(args):
    command = [sys.executable, "-m", "fairseq_moe_ext.checkpoint", *map(str, args)]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=150,
                          env=fairseq_env())
    if done.returncode == 0:
        pytest.fail(f"expected {' '.join(command)} to fail:\n{tail(done.stdout)}", pytrace=False)
    return done.stdout


# ---------------------------------------------------------------- what each case runs on

Make = Callable[[Inputs, Path], Tuple[List[str], List[Path]]]  # -> (arguments, directories that must not change)


def fresh_training(*flags, **model) -> Make:
    """fairseq-train into a new save dir, which must stay empty."""

    def make(inputs, work):
        save_dir = work / "ck"
        return train_args(inputs.data, save_dir, "--max-update", "2", *flags, **model), [save_dir]

    make.needs_checkpoints = False
    return make


def fresh_lm_training(*flags) -> Make:
    """fairseq-train of ``moe_transformer_lm`` (registered with a dataclass: fairseq applies no
    architecture function while parsing, so its flags are checked when the model is built)."""

    def make(inputs, work):
        save_dir = work / "ck"
        args = train_args(inputs.lm_data, save_dir, "--task", "language_modeling", "--tokens-per-sample", "32",
                          "--max-update", "2", *flags, arch="moe_transformer_lm", criterion="moe_cross_entropy")
        return args, [save_dir]

    make.needs_checkpoints = False
    return make


def resume(*flags, damage: Callable[[Path], None] = lambda save_dir: None, source="single") -> Make:
    """fairseq-train on a copy of a save dir (``damage`` applied to it first), which must not change."""

    def make(inputs, work):
        save_dir = copy_of(getattr(inputs, source), work)
        damage(save_dir)
        return train_args(inputs.data, save_dir, "--max-update", "6", *flags), [save_dir]

    return make


def generate_from(source: str, damage: Callable[[Path], None], path: str = "checkpoint_last.pt") -> Make:
    """fairseq-generate --path into a damaged copy of a checkpoint dir, which must not change."""

    def make(inputs, work):
        directory = copy_of(getattr(inputs, source), work)
        damage(directory)
        return [str(inputs.data), "--user-dir", USER_DIR, "--cpu", "--num-workers", "0", "--beam", "2",
                "--path", str(directory / path)], [directory]

    return make


def checkpoint_tool_on(command: str, *flags, existing: Optional[str] = None) -> Make:
    """``python -m fairseq_moe_ext.checkpoint <command> in/checkpoint_last.pt out/checkpoint_last.pt``
    with ``out`` holding the 1-process run's checkpoint_last.pt (``existing="single"``) or the 2-worker
    set of that name (``existing="set"``); neither directory may change."""

    def make(inputs, work):
        source = copy_of(inputs.set, work, "in")
        out = copy_of(getattr(inputs, existing), work, "out") if existing else work / "out"
        out.mkdir(exist_ok=True)
        return [command, source / "checkpoint_last.pt", out / "checkpoint_last.pt", *flags], [source, out]

    return make


def upcycle(*flags, damage: Callable[[Path], None] = lambda directory: None, source="dense",
            existing: Optional[str] = None) -> Make:
    """``python -m fairseq_moe_ext.checkpoint upcycle in/checkpoint_last.pt out/checkpoint_last.pt
    --moe-expert-count 4`` from a (damaged) copy of a save dir, into ``out`` holding ``existing``'s files
    (or nothing); neither directory may change."""

    def make(inputs, work):
        source_dir = copy_of(getattr(inputs, source), work, "in")
        damage(source_dir)
        out = copy_of(getattr(inputs, existing), work, "out") if existing else work / "out"
        out.mkdir(exist_ok=True)
        args = ["upcycle", source_dir / "checkpoint_last.pt", out / "checkpoint_last.pt", "--moe-expert-count", "4"]
        return [*args, *flags], [source_dir, out]

    return make


def training_upcycled_from_the_dense_model(*flags) -> Make:
    """fairseq-train of moe_transformer_tiny --moe-upcycle-from the dense checkpoint into a new save dir."""

    def make(inputs, work):
        save_dir = work / "ck"
        dense = ["--moe-upcycle-from", str(inputs.dense / "checkpoint_last.pt")]
        return train_args(inputs.data, save_dir, "--max-update", "2", *dense, *flags), [save_dir, inputs.dense]

    return make


def drop_the_ffn_blocks(directory: Path) -> None:
    """The dense checkpoint without fc1/fc2: a model whose feed-forward blocks are not fairseq's."""
    path = directory / "checkpoint_last.pt"
    state = torch.load(path, weights_only=False)  # the test's own file: trusted here, and only here
    state["model"] = {k: v for k, v in state["model"].items() if ".fc1." not in k and ".fc2." not in k}
    torch.save(state, path)


def tool_on_copy(command: str, source: str, damage: Callable[[Path], None], path: str = "checkpoint_last.pt",
                 output: Optional[str] = None) -> Make:
    """``python -m fairseq_moe_ext.checkpoint <command>`` on a damaged copy of a checkpoint dir, writing
    (``output``) into ``out/checkpoint_last.pt`` of an existing (``"existing"``) or missing (``"missing"``)
    directory; neither may change (a missing one must not appear)."""

    def make(inputs, work):
        directory = copy_of(getattr(inputs, source), work)
        damage(directory)
        args, watched = [command, directory / path], [directory]
        if output is not None:
            out = work / "out"
            if output == "existing":
                out.mkdir()
            args.append(out / "checkpoint_last.pt")
            watched.append(out)
        return args, watched

    return make


def list_rank_1_from_another_directory(absolute: bool) -> Callable[[Path], None]:
    """The manifest names rank 1's file by a path outside the set's directory, where the file now lies
    (intact: only where the manifest points is wrong)."""

    def damage(directory):
        name = "checkpoint_last-rank-1-of-2.pt"
        elsewhere = directory.parent / "elsewhere"
        elsewhere.mkdir()
        shutil.move(directory / name, elsewhere / name)
        manifest_file = directory / "checkpoint_last.set.json"
        manifest = json.loads(manifest_file.read_text())
        manifest["files"][1]["name"] = str(elsewhere / name) if absolute else f"../elsewhere/{name}"
        manifest_file.write_text(json.dumps(manifest))

    return damage


def keep_only_rank_1(directory: Path) -> None:
    """Rank 1's file copied out of its set, alone in its directory."""
    for path in directory.iterdir():
        if path.name != "checkpoint_last-rank-1-of-2.pt":
            path.unlink()


def rename_rank_1_to_a_plain_name(directory: Path) -> None:
    shutil.copy(directory / "checkpoint_last-rank-1-of-2.pt", directory / "checkpoint_x.pt")


def leave_a_rank_file_of_a_4_worker_save(directory: Path) -> None:
    shutil.copy(directory / "checkpoint_last-rank-0-of-2.pt", directory / "checkpoint_last-rank-0-of-4.pt")


def replace_rank_1_with_another_runs(inputs: Inputs) -> Callable[[Path], None]:
    name = "checkpoint_last-rank-1-of-2.pt"
    return lambda directory: shutil.copy(inputs.other_set / name, directory / name)


def lock_held_by_this_test_runner(directory: Path) -> None:
    """The save dir's lock, as a job that is still running (this pytest process) holds it."""
    from fairseq_moe_ext import save_dir_lock

    holder = dict(host=save_dir_lock.this_job().host, pid=os.getpid(), started=save_dir_lock.this_job().started, job="first")
    (directory / save_dir_lock.LOCK_NAME).write_text(json.dumps(holder))


def locked_fresh_save_dir() -> Make:
    """fairseq-train into a save dir that holds only the lock of a running job."""
    fresh = fresh_training()

    def make(inputs, work):
        args, watched = fresh(inputs, work)
        watched[0].mkdir()
        lock_held_by_this_test_runner(watched[0])
        return args, watched

    make.needs_checkpoints = False
    return make


def restore_file_naming_a_damaged_set() -> Make:
    """fairseq-train --restore-file ck/checkpoint_last.pt, a set that lost rank 1's file, beside a
    complete set (checkpoint_older) that the implicit default would fall back to."""

    def make(inputs, work):
        save_dir = copy_of(inputs.set, work)
        manifest = json.loads((save_dir / "checkpoint_last.set.json").read_text())
        for entry in manifest["files"]:
            older = entry["name"].replace("checkpoint_last", "checkpoint_older")
            shutil.copy(save_dir / entry["name"], save_dir / older)
            entry["name"] = older
        (save_dir / "checkpoint_older.set.json").write_text(json.dumps(dict(manifest, name="checkpoint_older")))
        (save_dir / "checkpoint_last-rank-1-of-2.pt").unlink()
        restore = ["--restore-file", str(save_dir / "checkpoint_last.pt")]
        return train_args(inputs.data, save_dir, "--max-update", "6", *restore), [save_dir]

    return make


# ---------------------------------------------------------------- the catalogue

@dataclass(frozen=True)
class Case:
    id: str
    tool: Callable[[List[str]], str]
    make: Make
    error: str  # how the last error line starts: the exception type, or "<prog>: error" / "error"
    problem: str  # substrings of that line naming the problem ...
    fix: str  # ... and the fix

    @property
    def needs_checkpoints(self) -> bool:
        return getattr(self.make, "needs_checkpoints", True)

    def __str__(self):
        return self.id


def with_inputs(factory) -> Make:
    """A Make built from the trained inputs (for damage that needs another run's files)."""
    return lambda inputs, work: factory(inputs)(inputs, work)


# The same size as the set's own file (same shapes, other values): the manifest's sha256 tells them apart.
ANOTHER_RUNS_FILE = (
    "checkpoint_last-rank-1-of-2.pt does not match its sha256 in the manifest (corrupted, or replaced by another "
    "run's file)"
)

CASES = [
    # -- MoE flags, checked while fairseq parses the command line (nothing read, nothing created)
    Case("top-k-above-expert-count", fairseq_train, fresh_training("--moe-top-k", "5"), "ValueError",
         "--moe-top-k 5 exceeds --moe-expert-count 4", "use --moe-top-k <= 4"),
    Case("top-k-zero", fairseq_train, fresh_training("--moe-top-k", "0"), "ValueError",
         "--moe-top-k must be an integer >= 1, got 0", "use 1 <= --moe-top-k <= 4"),
    Case("zero-experts", fairseq_train, fresh_training("--moe-expert-count", "0"), "ValueError",
         "--moe-expert-count must be a positive integer, got 0", "use 1 or more experts"),
    Case("nan-capacity-factor", fairseq_train, fresh_training("--moe-capacity-factor", "nan"), "ValueError",
         "--moe-capacity-factor must be a finite number, got nan", "use 0 for dropless routing"),
    Case("infinite-eval-capacity-factor", fairseq_train, fresh_training("--moe-eval-capacity-factor", "inf"),
         "ValueError", "--moe-eval-capacity-factor must be a finite number, got inf",
         "> 0 for a fixed capacity, < 0 for a bounded dropless one"),
    Case("negative-gate-noise", fairseq_train, fresh_training("--moe-gate-noise", "-1"), "ValueError",
         "--moe-gate-noise must be a finite number >= 0, got -1.0", "use 0 (no noise) or a standard deviation > 0"),
    Case("negative-moe-freq", fairseq_train, fresh_training("--moe-freq", "-1"), "ValueError",
         "--moe-freq must be an integer >= 0, got -1", "use N for an MoE layer every N layers, or 0 for none"),
    Case("moe-freq-placing-no-moe-layer", fairseq_train, fresh_training("--moe-freq", "4"), "ValueError",
         "--moe-freq 4 places no MoE layer in this model (2 encoder layers and 2 decoder layers;",
         "use a frequency between 1 and 2, or a dense --arch (transformer, transformer_lm)"),
    Case("zero-expert-ffn-dim", fairseq_train, fresh_training("--moe-expert-ffn-dim", "0"), "ValueError",
         "--moe-expert-ffn-dim must be a positive integer, got 0", "drop it to use the layer's ffn dim"),
    Case("zero-expert-parallel-size", fairseq_train, fresh_training("--moe-expert-parallel-size", "0"), "ValueError",
         "--moe-expert-parallel-size must be a positive integer, got 0",
         "use a P dividing both the number of workers and --moe-expert-count, or drop it for the default"),
    Case("zero-comm-timeout", fairseq_train, fresh_training("--moe-comm-timeout", "0"), "ValueError",
         "--moe-comm-timeout must be a positive number of seconds, got 0.0", "use e.g. 600"),
    Case("unknown-router", fairseq_train, fresh_training("--moe-router", "hash"), "train.py: error",
         "argument --moe-router: invalid choice: 'hash'", "choose from 'top', 'cosine'"),
    Case("negative-shared-expert-count", fairseq_train, fresh_training("--moe-shared-expert-count", "-1"),
         "ValueError", "--moe-shared-expert-count must be an integer >= 0, got -1", "use 0 for no shared experts"),
    Case("bias-update-rate-without-bias-balancing", fairseq_train, fresh_training("--moe-bias-update-rate", "0.01"),
         "ValueError", "--moe-bias-update-rate has no effect without --moe-balance bias", "add it or drop the rate"),
    Case("zero-bias-update-rate", fairseq_train,
         fresh_training("--moe-balance", "bias", "--moe-bias-update-rate", "0"), "ValueError",
         "--moe-bias-update-rate must be a finite number > 0, got 0.0", "use e.g. 0.001"),
    Case("sigmoid-router-with-one-expert-per-token", fairseq_train,
         fresh_training("--moe-router", "sigmoid", "--moe-top-k", "1"), "ValueError",
         "--moe-router sigmoid normalises the gates over the chosen experts, so with --moe-top-k 1 every gate is 1",
         "use --moe-top-k 2 or more, or --moe-router top"),
    Case("language-model-top-k-above-expert-count", fairseq_train,
         fresh_lm_training("--moe-expert-count", "2", "--moe-top-k", "3"), "ValueError",
         "--moe-top-k 3 exceeds --moe-expert-count 2", "use --moe-top-k <= 2"),
    # -- MoE options and components next to dense ones
    Case("moe-flag-on-a-dense-architecture", fairseq_train,
         fresh_training("--moe-expert-count", "4", arch="transformer", criterion="label_smoothed_cross_entropy"),
         "train.py: error", "--moe-expert-count is an option of the MoE architectures only",
         "not of --arch transformer; pass one of them as --arch, or drop --moe-expert-count"),
    Case("moe-loss-flag-with-a-plain-criterion", fairseq_train,
         fresh_training("--moe-gate-loss-wt", "0.1", criterion="label_smoothed_cross_entropy"), "train.py: error",
         "--moe-gate-loss-wt is an option of the MoE criterions only",
         "pass one of them as --criterion, or drop --moe-gate-loss-wt"),
    Case("moe-criterion-on-a-dense-architecture", fairseq_train,
         fresh_training("--encoder-layers", "1", "--decoder-layers", "1", arch="transformer"), "ValueError",
         "--criterion moe_label_smoothed_cross_entropy collects MoE balance losses, but --arch transformer has "
         "no MoE layers", "use --arch moe_transformer* / moe_transformer_lm*"),
    Case("plain-criterion-on-an-moe-architecture", fairseq_train,
         fresh_training(criterion="label_smoothed_cross_entropy"),
         "fairseq_moe_ext.moe.cache.UncollectedMoELossError",
         "MoE balance losses of 2 layer run(s) from the previous training forward pass were never collected",
         "train MoE models with an MoE criterion (--criterion moe_cross_entropy or moe_label_smoothed_cross_entropy)"),
    # -- several workers
    Case("expert-parallel-size-not-dividing-the-workers", two_workers, fresh_training("--moe-expert-parallel-size", "3"),
         "ValueError", "--moe-expert-parallel-size 3 does not divide the 2 workers",
         "use a P dividing both 2 and --moe-expert-count 4 (1 or 2)"),
    Case("expert-parallel-size-not-dividing-the-experts", two_workers,
         fresh_training("--moe-expert-count", "3", "--moe-expert-parallel-size", "2"), "ValueError",
         "--moe-expert-parallel-size 2 does not divide --moe-expert-count 3",
         "use a P dividing both 2 and --moe-expert-count 3 (1)"),
    Case("ddp-backend-that-would-average-experts", two_workers, fresh_training("--ddp-backend", "slowmo"),
         "ValueError", "--ddp-backend slowmo is not supported with MoE models",
         "use --ddp-backend legacy_ddp (or c10d / pytorch_ddp / fully_sharded)"),
    # -- --ddp-backend fully_sharded (torch FSDP2): options it cannot honour, checked while parsing
    Case("fully-sharded-with-cpu-offload", fairseq_train, fresh_training("--ddp-backend", "fully_sharded", "--cpu-offload"),
         "ValueError", "--cpu-offload is fairscale's and is not supported with --ddp-backend fully_sharded",
         "drop --cpu-offload"),
    Case("fully-sharded-with-sharded-state", fairseq_train,
         fresh_training("--ddp-backend", "fully_sharded", "--use-sharded-state"), "ValueError",
         "--use-sharded-state writes fairscale's per-shard files", "drop --use-sharded-state"),
    Case("fully-sharded-with-ema", fairseq_train, fresh_training("--ddp-backend", "fully_sharded", "--store-ema"),
         "ValueError", "--store-ema keeps a whole copy of the model on every worker",
         "drop --store-ema or use --ddp-backend legacy_ddp"),
    Case("fully-sharded-with-fp16", fairseq_train, fresh_training("--ddp-backend", "fully_sharded", "--fp16"),
         "ValueError", "--fp16 is not mapped onto torch FSDP2's mixed precision yet",
         "train --ddp-backend fully_sharded in fp32 (drop --fp16)"),
    Case("zero-sharding-of-expert-optimizer-state", fairseq_train, fresh_training("--zero-sharding", "os"),
         "ValueError", "--zero-sharding os broadcasts every worker's optimizer shard",
         "use --ddp-backend fully_sharded"),
    Case("out-of-memory-on-one-of-two-workers", two_workers_one_running_out_of_memory,
         fresh_training("--no-save", "--moe-comm-timeout", "30"),  # a hang would end there, not at 600 s
         "fairseq_moe_ext.fairseq_integration.training.MoEOutOfMemoryError",
         "worker 1 of 2 ran out of device memory in training",
         "bound them with --moe-capacity-factor (e.g. 1.25) or lower --max-tokens"),
    Case("launcher-and-fairseq-disagree-on-world-size", two_workers_without_world_size, fresh_training(),
         "ValueError", "the launcher started 2 workers (WORLD_SIZE=2) but fairseq runs each of them as a 1-worker job",
         "add --distributed-world-size 2"),
    # -- resuming
    Case("resume-with-another-expert-count", fairseq_train, resume("--moe-expert-count", "8"), "ValueError",
         "holds 4 experts in encoder.layers.1.fc1, this model 8",
         "resume with the checkpoint's --moe-expert-count, or use a new --save-dir"),
    Case("resume-with-another-model-dimension", fairseq_train, resume("--encoder-embed-dim", "32"), "ValueError",
         "does not fit this model: encoder.embed_tokens.weight is (48, 64) there and (48, 32) here",
         "resume with the architecture flags the checkpoint was trained with, or use a new --save-dir"),
    Case("resume-with-another-router", fairseq_train, resume("--moe-router", "cosine"), "ValueError",
         "was trained with --moe-router top and this run has --moe-router cosine",
         "resume with --moe-router top, or use a new --save-dir"),
    Case("resume-with-shared-experts-added", fairseq_train, resume("--moe-shared-expert-count", "1"), "ValueError",
         "was trained with --moe-shared-expert-count 0 and this run has --moe-shared-expert-count 1",
         "resume with --moe-shared-expert-count 0, or use a new --save-dir"),
    Case("resume-from-a-checkpoint-pickling-a-disallowed-type", fairseq_train,
         resume(damage=lambda d: pickle_a_disallowed_type(d / "checkpoint_last.pt")), UNSAFE,
         f"checkpoint_last.pt: it pickles {Smuggled.__module__}.Smuggled, which is not among the types fairseq "
         "checkpoints store",
         "if you trust the file, add the type to fairseq_moe_ext.checkpoint.CHECKPOINT_SAFE_GLOBALS"),
    Case("resume-from-a-truncated-file", fairseq_train, resume(damage=lambda d: truncate(d / "checkpoint_last.pt")),
         DAMAGED, "checkpoint_last.pt is damaged or incomplete (File is not a zip file)",
         "restore it from a backup, or point --path / --restore-file at another checkpoint"),
    Case("resume-from-a-set-with-another-runs-rank-file", fairseq_train,
         with_inputs(lambda inputs: resume(damage=replace_rank_1_with_another_runs(inputs), source="set")), SET,
         f"{ANOTHER_RUNS_FILE}) and no complete set exists in",
         "restore the set's files from a backup, or start afresh in a new --save-dir"),
    Case("resume-where-a-name-has-two-layouts", fairseq_train,
         resume(damage=lambda d: (d / "checkpoint_last-rank-0-of-2.pt").write_bytes(b"not really")), SET,
         "checkpoint_last.pt exists beside per-rank files of the same name", "two layouts for one checkpoint; "
         "move one of them away"),
    Case("restore-file-naming-a-damaged-set", fairseq_train, restore_file_naming_a_damaged_set(), SET,
         "checkpoint_last.set.json cannot be loaded: rank 1 file",
         "or add --moe-restore-fallback to train from the newest complete set in"),
    # -- one job per save dir
    Case("save-dir-locked-by-a-running-job", fairseq_train, resume(damage=lock_held_by_this_test_runner),
         "fairseq_moe_ext.save_dir_lock.SaveDirLockedError", "is locked by job first (pid",
         "which is still running: two jobs saving into one directory overwrite each other's checkpoints; give this "
         "run another --save-dir, or, if that job is gone, delete"),
    Case("save-dir-locked-by-a-running-job-on-two-workers", two_workers, locked_fresh_save_dir(),
         "fairseq_moe_ext.save_dir_lock.SaveDirLockedError", "is locked by job first (pid",
         "give this run another --save-dir, or, if that job is gone, delete"),
    # -- generation: --path never loads anything but the complete, intact checkpoint it names
    Case("generate-from-a-set-missing-a-rank-file", fairseq_generate,
         generate_from("set", lambda d: (d / "checkpoint_last-rank-1-of-2.pt").unlink()), SET,
         "checkpoint_last-rank-1-of-2.pt is missing", "restore the set from a backup, or point --path"),
    Case("generate-from-a-set-with-a-corrupted-rank-file", fairseq_generate,
         generate_from("set", lambda d: flip_bytes_in_the_middle(d / "checkpoint_last-rank-1-of-2.pt")), SET,
         "checkpoint_last-rank-1-of-2.pt does not match its sha256 in the manifest",
         "restore the set from a backup, or point --path"),
    Case("generate-from-a-set-with-another-runs-rank-file", fairseq_generate,
         with_inputs(lambda inputs: generate_from("set", replace_rank_1_with_another_runs(inputs))), SET,
         ANOTHER_RUNS_FILE, "restore the set from a backup, or point --path"),
    Case("generate-from-a-stale-rank-file-of-another-world-size", fairseq_generate,
         generate_from("set", leave_a_rank_file_of_a_4_worker_save, path="checkpoint_last-rank-0-of-4.pt"), SET,
         "checkpoint_last-rank-0-of-4.pt is not part of the checkpoint set",
         "pass the set's plain name"),
    Case("generate-from-a-truncated-file", fairseq_generate,
         generate_from("single", lambda d: truncate(d / "checkpoint_last.pt")), DAMAGED,
         "checkpoint_last.pt is damaged or incomplete", "restore it from a backup, or point --path"),
    Case("generate-from-a-corrupted-file", fairseq_generate,
         generate_from("single", lambda d: flip_bytes_in_the_middle(d / "checkpoint_last.pt")), DAMAGED,
         "checkpoint_last.pt is damaged or incomplete (Bad CRC-32 for file",
         "restore it from a backup, or point --path"),
    # -- the checkpoint tool never overwrites and never writes half a set
    Case("reshard-to-an-expert-parallel-size-not-dividing-the-experts", checkpoint_tool,
         checkpoint_tool_on("reshard", "--world-size", "3", "--expert-parallel-size", "3"), "error",
         "--expert-parallel-size 3 must divide both --world-size 3 and the 4 experts", "use one of [1]"),
    Case("reshard-to-zero-workers", checkpoint_tool, checkpoint_tool_on("reshard", "--world-size", "0"), "error",
         "--world-size must be a positive number of workers, got 0",
         "use the number of workers that will resume from the set"),
    Case("reshard-onto-a-single-file-of-the-same-name", checkpoint_tool,
         checkpoint_tool_on("reshard", "--world-size", "2", existing="single"), "error",
         "out/checkpoint_last.pt exists", "choose another output name (nothing was overwritten)"),
    Case("merge-onto-a-set-of-the-same-name", checkpoint_tool, checkpoint_tool_on("merge", existing="set"), "error",
         "out/checkpoint_last.set.json exists", "choose another output name (nothing was overwritten)"),
    Case("merge-into-a-missing-directory", checkpoint_tool, tool_on_copy("merge", "set", lambda d: None, output="missing"),
         "error", "out does not exist", "create it first, or choose another output name (nothing was written)"),
    # -- sparse upcycling: only a dense checkpoint with fairseq's FFN, into experts of its size, into a new name
    Case("upcycle-a-checkpoint-without-fc1-fc2", checkpoint_tool, upcycle(damage=drop_the_ffn_blocks), "error",
         "has no fairseq feed-forward block (no encoder/decoder.layers.N.fc1/fc2 weights)",
         "upcycling needs a dense checkpoint of an architecture whose FFN is fc1/fc2 (transformer, transformer_lm)"),
    Case("upcycle-an-moe-checkpoint", checkpoint_tool, upcycle(source="single"), "error",
         "checkpoint_last.pt is already an MoE checkpoint (it holds experts)",
         "upcycling starts from a dense fairseq checkpoint; train on from this one with --restore-file"),
    Case("upcycle-into-experts-of-another-hidden-size", checkpoint_tool, upcycle("--moe-expert-ffn-dim", "256"),
         "error", "--moe-expert-ffn-dim 256 differs from the dense FFN's hidden size 128 (decoder.layers.0.fc1",
         "every expert starts as a copy of the dense FFN; drop --moe-expert-ffn-dim or pass 128"),
    Case("upcycle-onto-an-existing-checkpoint", checkpoint_tool, upcycle(existing="single"), "error",
         "out/checkpoint_last.pt exists", "choose another output name (nothing was overwritten)"),
    Case("train-upcycled-without-normalised-gates", fairseq_train, training_upcycled_from_the_dense_model(),
         "ValueError", "--moe-upcycle-from needs --moe-normalize-gate: without it a token's k gates sum to less than 1",
         "add --moe-normalize-gate"),
    Case("train-upcycled-into-experts-of-another-hidden-size", fairseq_train,
         training_upcycled_from_the_dense_model("--moe-normalize-gate", "--moe-expert-ffn-dim", "256"), SET,
         "--moe-expert-ffn-dim 256 differs from the dense FFN's hidden size 128", "drop --moe-expert-ffn-dim or pass 128"),
    Case("train-upcycled-with-a-cosine-router", fairseq_train,
         training_upcycled_from_the_dense_model("--moe-normalize-gate", "--moe-router", "cosine"), "ValueError",
         "this run has --moe-router cosine", "use --moe-router top"),
    Case("train-upcycled-and-restored-from-a-file-at-once", fairseq_train,
         training_upcycled_from_the_dense_model("--moe-normalize-gate", "--restore-file", "elsewhere.pt"), "ValueError",
         "--moe-upcycle-from and --restore-file both name a checkpoint to start from", "pass one of them"),
    # -- a manifest is untrusted input: no file outside the set's directory is ever opened
    Case("generate-from-a-set-whose-manifest-names-a-file-in-another-directory", fairseq_generate,
         generate_from("set", list_rank_1_from_another_directory(absolute=False)), SET,
         "field files[1].name must be 'checkpoint_last-rank-1-of-2.pt', got '../elsewhere/checkpoint_last-rank-1-of-2.pt' "
         "(a path: a set's files must lie beside its manifest)", "restore it from a backup, or move the set out"),
    Case("generate-from-a-set-whose-manifest-names-an-absolute-path", fairseq_generate,
         generate_from("set", list_rank_1_from_another_directory(absolute=True)), SET,
         "elsewhere/checkpoint_last-rank-1-of-2.pt' (a path: a set's files must lie beside its manifest)",
         "restore it from a backup, or move the set out"),
    Case("inspect-a-set-whose-manifest-names-a-file-in-another-directory", checkpoint_tool,
         tool_on_copy("inspect", "set", list_rank_1_from_another_directory(absolute=False)), "error",
         "got '../elsewhere/checkpoint_last-rank-1-of-2.pt' (a path", "restore it from a backup, or move the set out"),
    Case("inspect-a-set-whose-manifest-names-an-absolute-path", checkpoint_tool,
         tool_on_copy("inspect", "set", list_rank_1_from_another_directory(absolute=True)), "error",
         "elsewhere/checkpoint_last-rank-1-of-2.pt' (a path", "restore it from a backup, or move the set out"),
    # -- a .pt file that is not a fairseq checkpoint at all
    Case("generate-from-a-pt-file-holding-a-list", fairseq_generate,
         generate_from("single", lambda d: torch.save([1, 2], d / "checkpoint_last.pt")), NOT_A_CHECKPOINT,
         "checkpoint_last.pt is not a fairseq checkpoint: it holds a list",
         "point --path / --restore-file (or the checkpoint tool) at a checkpoint written by fairseq-train"),
    Case("inspect-a-pt-file-holding-a-dict-of-something-else", checkpoint_tool,
         tool_on_copy("inspect", "single", lambda d: torch.save({"a": 1}, d / "checkpoint_last.pt")), "error",
         "checkpoint_last.pt is not a fairseq checkpoint: it holds a dict without a model state (keys ['a'])",
         "point --path / --restore-file (or the checkpoint tool) at a checkpoint written by fairseq-train"),
    # -- a rank file out of its set is recognised as a part, and names its set
    Case("generate-from-a-rank-file-renamed-to-a-plain-name", fairseq_generate,
         generate_from("set", rename_rank_1_to_a_plain_name, path="checkpoint_x.pt"), SET,
         "checkpoint_x.pt is one part of a checkpoint set, not a whole checkpoint: rank 1 of 2 (set ",
         "put it back beside its set's other rank files and manifest, and pass the set's name"),
    Case("merge-a-rank-file-copied-out-of-its-set", checkpoint_tool,
         tool_on_copy("merge", "set", keep_only_rank_1, path="checkpoint_last-rank-1-of-2.pt", output="existing"),
         "error", "1 rank files (the first is rank 1 of 2 of checkpoint_last (set ",
         "copy the set's other rank files and its manifest beside them"),
]


# ---------------------------------------------------------------- running them

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
    return lines[i][match.start(1):], following


@dataclass
class Started:
    future: Future
    watched: List[Path]
    before: Dict[Path, Dict[str, str]]


@pytest.fixture(scope="module")
def pool():
    """Where the runs go: two at a time, one per core."""
    executor = ThreadPoolExecutor(max_workers=2)
    yield executor
    executor.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def data(parallel_data, lm_data) -> Inputs:
    return Inputs(data=parallel_data, lm_data=lm_data)


@pytest.fixture(scope="module")
def checkpoints(pool, data, tmp_path_factory) -> Future:
    """Inputs with trained checkpoints, once the training started here has finished."""
    return pool.submit(train_checkpoints, data, tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def started(request, pool, data, tmp_path_factory):
    """Prepare and start every selected case: {case id: Started}."""
    wanted = {item.callspec.params["case"].id for item in request.session.items
              if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})}
    cases = [c for c in request.module.CASES if c.id in wanted]  # this module's table (or another's that imports it)
    trained = request.getfixturevalue("checkpoints") if any(c.needs_checkpoints for c in cases) else None
    root = tmp_path_factory.mktemp("cases")
    runs = {}
    for case in sorted(cases, key=lambda c: c.needs_checkpoints):  # those that need only data go first
        work = root / case.id
        work.mkdir()
        args, watched = case.make(trained.result() if case.needs_checkpoints else data, work)
        runs[case.id] = Started(pool.submit(case.tool, args), watched, {d: fingerprint(d) for d in watched})
    return runs


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input_fails_fast_with_one_line_naming_the_problem_and_the_fix_and_changes_no_file(case, started):
    check_case(case, started[case.id])


def check_case(case: Case, run: Started) -> None:
    output = run.future.result()  # the tool's runner already failed the test if the tool succeeded or hung
    line, following = last_error_line(output)
    assert line.startswith(case.error + ": "), f"{line}\n{tail(output, 60)}"
    assert case.problem in line, line
    assert case.fix in line, line
    assert not following[:1].isspace(), f"the error goes on over several lines:\n{line}\n{following}"
    for directory in run.watched:
        assert fingerprint(directory) == run.before[directory], f"{directory} changed"


# ---------------------------------------------------------------- what is not an error

def test_a_missing_plain_name_stays_fairseqs_own_error(checkpoints, tmp_path):
    inputs = checkpoints.result()
    directory = copy_of(inputs.single, tmp_path)
    (directory / "checkpoint_last-rank-0-of-2.pt").write_bytes(b"not really")
    output = run_fairseq("generate", str(inputs.data), "--user-dir", USER_DIR, "--cpu",
                         "--path", str(directory / "checkpoint_last.pt.missing"), expect_failure=True)
    assert "Model file not found" in output


def test_a_rank_file_given_as_path_stands_for_its_whole_set(checkpoints):
    """Alone, a rank file holds one worker's experts; --path to it loads the set that lists it,
    as the plain name does (and as --restore-file and the checkpoint tool do)."""
    inputs = checkpoints.result()
    output = run_fairseq("generate", str(inputs.data), "--user-dir", USER_DIR, "--cpu", "--num-workers", "0",
                         "--beam", "2", "--path", str(inputs.set / "checkpoint_last-rank-1-of-2.pt"))
    assert re.search(r"^H-\d+\t", output, flags=re.M) and "BLEU" in output
