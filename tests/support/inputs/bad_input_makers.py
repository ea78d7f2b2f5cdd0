"""What each case of the bad-input catalogue (tests/cli/test_bad_input*.py) runs on: a ``Make``
builds a case's arguments and names the directories that must not change, from the trained inputs
(bad_input_runner.train_checkpoints) or from the data alone; the damage functions break a copy.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Callable, List, Optional

import torch

from support.launch.bad_input_runner import Inputs, Make, copy_of, train_args
from support.launch.fairseq_helpers import USER_DIR

# ---------------------------------------------------------------- damage done to a copy


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


# ---------------------------------------------------------------- what each case runs on


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
        args = train_args(
            inputs.lm_data,
            save_dir,
            "--task",
            "language_modeling",
            "--tokens-per-sample",
            "32",
            "--max-update",
            "2",
            *flags,
            arch="moe_transformer_lm",
            criterion="moe_cross_entropy",
        )
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


def generate_args(data, path: Path) -> List[str]:
    """fairseq-generate's command line (beam 2, on the CPU) for the checkpoint ``path``."""
    return [str(data), "--user-dir", USER_DIR, "--cpu", "--num-workers", "0", "--beam", "2", "--path", str(path)]


def generate_from(source: str, damage: Callable[[Path], None], path: str = "checkpoint_last.pt") -> Make:
    """fairseq-generate --path into a damaged copy of a checkpoint dir, which must not change."""

    def make(inputs, work):
        directory = copy_of(getattr(inputs, source), work)
        damage(directory)
        return generate_args(inputs.data, directory / path), [directory]

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


def upcycle(
    *flags, damage: Callable[[Path], None] = lambda directory: None, source="dense", existing: Optional[str] = None
) -> Make:
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


def tool_on_copy(
    command: str,
    source: str,
    damage: Callable[[Path], None],
    path: str = "checkpoint_last.pt",
    output: Optional[str] = None,
) -> Make:
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
    from fairseq_moe_ext.training import save_dir_lock

    holder = dict(
        host=save_dir_lock.this_job().host, pid=os.getpid(), started=save_dir_lock.this_job().started, job="first"
    )
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


def with_inputs(factory) -> Make:
    """A Make built from the trained inputs (for damage that needs another run's files)."""
    return lambda inputs, work: factory(inputs)(inputs, work)


def import_release_lookalike(langs) -> Make:
    """``import-fairseq-moe`` of the NLLB-200 MoE release lookalike (``recipes/nllb_tiny_set.py``, its first E
    rank files) with ``--dictionary`` and a ``--langs`` file holding ``langs`` (text, or bytes as they are); the
    set and the output directory must not change."""

    def make(inputs, work):
        import sys

        from support.launch.paths import REPO_ROOT

        sys.path.insert(0, str(REPO_ROOT / "recipes"))
        from nllb_tiny_set import write_release_set

        prefix = write_release_set(str(work / "nllb"), first_experts_only=True)
        written = (work / "langs.txt").write_bytes if isinstance(langs, bytes) else (work / "langs.txt").write_text
        written(langs)
        (work / "out").mkdir()
        dictionary, listed = work / "nllb" / "dictionary.txt", work / "langs.txt"
        args = [
            "import-fairseq-moe",
            prefix,
            work / "out" / "imported.pt",
            "--dictionary",
            dictionary,
            "--langs",
            listed,
        ]
        return args, [work / "nllb", work / "out"]

    make.needs_checkpoints = False
    return make
