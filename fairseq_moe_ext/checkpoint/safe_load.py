"""Loading a checkpoint file safely: only the types fairseq checkpoints store, the zip archive's
CRC-32s checked first, and every failure to load told as one line.

``safe_load`` is the one protocol every loader of a checkpoint file goes through, whether it loads
with torch.load (the checkpoint tool, merging a set) or with fairseq's ``load_checkpoint_to_cpu``
(training and generation; see fairseq_integration/loading.py).
"""

import argparse
import collections
import contextlib
import functools
import os
import pickle
import re
import zipfile
from typing import Callable, Dict, Optional

import numpy
import torch

from .contents import check_is_checkpoint
from .errors import CheckpointError, DamagedCheckpointError, UnsafeCheckpointError, load_another


def _numpy_array_globals():
    """--eval-bleu keeps its BLEU counters as numpy arrays and scalars in the checkpoint's metrics."""
    multiarray = getattr(numpy, "_core", None) or numpy.core
    dtype_classes = {
        type(numpy.dtype(t)) for t in (numpy.bool_, numpy.int32, numpy.int64, numpy.float32, numpy.float64)
    }
    return [
        multiarray.multiarray._reconstruct,
        multiarray.multiarray.scalar,
        numpy.ndarray,
        numpy.dtype,
        *sorted(dtype_classes, key=str),
    ]


def _other_numpy_names(allowed):
    """The names the other numpy major version pickles the same objects by: numpy 1.x wrote
    ``numpy.core.multiarray.scalar`` / ``_reconstruct`` where numpy 2 writes ``numpy._core.multiarray.*`` (and
    numpy 2 keeps ``numpy.core`` only as a shim that torch's unpickler does not look through). Each is the
    ``(object, name)`` pair torch's ``safe_globals`` takes: the same object already allowed, under its other name."""
    aliases = []
    for obj in allowed:
        module = getattr(obj, "__module__", "") or ""
        for ours, theirs in (("numpy._core.", "numpy.core."), ("numpy.core.", "numpy._core.")):
            if module.startswith(ours):
                aliases.append((obj, f"{theirs}{module[len(ours) :]}.{obj.__qualname__}"))
    return aliases


# What fairseq 0.12 stores in a checkpoint besides tensors and builtins (an argparse model's
# ``cfg.model`` is a Namespace; --eval-bleu's counters are numpy arrays), found by listing the
# globals of real translation and LM checkpoints with torch.serialization.get_unsafe_globals_in_checkpoint;
# and the numpy objects among them under the names a checkpoint pickled under the other numpy major
# version gives them (a fairseq checkpoint saved under numpy 1.x: NLLB-200's, every older dense model).
# fmt: off
_FAIRSEQ_GLOBALS = [
    argparse.Namespace,
    collections.OrderedDict,
    collections.defaultdict,
    *_numpy_array_globals(),
]
CHECKPOINT_SAFE_GLOBALS = [*_FAIRSEQ_GLOBALS, *_other_numpy_names(_FAIRSEQ_GLOBALS)]
# fmt: on

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6
PICKLE_MAGIC = b"\x80"  # the legacy format: a pickle


def check_file_intact(path: str) -> None:
    """Raise DamagedCheckpointError unless ``path`` is a whole torch checkpoint.

    torch.save writes a zip archive with a CRC-32 per member, but torch.load checks none of them:
    a file corrupted on disk or in transfer loads with wrong weights, and a truncated one fails deep
    inside torch's zip reader. Reading every member through ``zipfile`` verifies them (one read of
    the file; a set's rank files are verified by the sha256s of their manifest instead).
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(len(ZIP_MAGIC))
    except OSError:
        return  # not ours to report: the loader names a missing file in its own words
    if magic != ZIP_MAGIC:
        if not magic.startswith(PICKLE_MAGIC):
            raise DamagedCheckpointError(
                f"{path} is not a torch checkpoint ({'empty' if not magic else 'unknown format'}): it was "
                f"truncated, overwritten or never finished; {load_another()}"
            )
        return  # a legacy (pre-zip) file: torch.load judges it
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                if member.CRC == 0:
                    continue  # written with torch's CRC-32 switched off: nothing to compare with
                with archive.open(member) as data:
                    while data.read(1 << 24):
                        pass
    except (zipfile.BadZipFile, EOFError, ValueError) as error:
        raise DamagedCheckpointError(
            f"{path} is damaged or incomplete ({error}): it was truncated or corrupted after it was "
            f"written; {load_another()}"
        ) from None


def unloadable_error(path: str, error: BaseException) -> Optional[CheckpointError]:
    """torch.load's error as one line: a refused type (weights_only) or a file cut short or garbled
    (legacy format; zip files are checked before loading). None for anything else."""
    text = str(error)
    refused = re.search(r"GLOBAL ([\w.]+)", text)
    if isinstance(error, pickle.UnpicklingError) and refused:
        return UnsafeCheckpointError(
            f"refusing to load {path}: it pickles {refused.group(1)}, which is not among the types fairseq "
            f"checkpoints store; if you trust the file, add the type to "
            f"fairseq_moe_ext.checkpoint.CHECKPOINT_SAFE_GLOBALS"
        )
    if isinstance(error, (EOFError, pickle.UnpicklingError)) or "corrupt" in text or "EOF" in text:
        first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        return DamagedCheckpointError(f"{path} is damaged or incomplete ({first}); {load_another()}")
    return None


# Every load of a user's file unpickles only tensors and CHECKPOINT_SAFE_GLOBALS: a pickle that would run
# code (os.system, open) is refused (tests/checkpoint/test_untrusted_pickles.py, one test per loader).
WEIGHTS_ONLY = True


def _torch_load_on_cpu(path: str):
    return torch.load(path, map_location="cpu", weights_only=WEIGHTS_ONLY)


@contextlib.contextmanager
def _weights_only_by_default():
    """fairseq's load_checkpoint_to_cpu calls torch.load without ``weights_only``: torch's default (True
    since 2.6) would decide, and TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (torch's own advice for old files) turn
    it off. While fairseq loads, ``weights_only`` is passed explicitly."""
    original = torch.load

    @functools.wraps(original)
    def load(*args, **kwargs):
        kwargs.setdefault("weights_only", WEIGHTS_ONLY)
        return original(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def is_zip_checkpoint(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(ZIP_MAGIC)) == ZIP_MAGIC
    except OSError:
        return False


@contextlib.contextmanager
def mapping_loads_of(path: str):
    """While active, a ``torch.load`` of a file object opened on ``path`` (fairseq's ``load_checkpoint_to_cpu``
    opens the file itself, and torch maps only files named by path) maps the file instead of reading it
    (``mmap=True``; the same restricted unpickler): a tensor's bytes are read from disk when first used, and
    tensors never used (another worker's experts, optimizer state a generation drops) take no memory. Only
    torch's zip format can be mapped; any other ``torch.load`` is torch's own."""
    real_load, target = torch.load, os.path.realpath(path)

    def load(f, *args, **kwargs):
        name = getattr(f, "name", None)
        if isinstance(name, str) and "mmap" not in kwargs and os.path.realpath(name) == target:
            return real_load(target, *args, mmap=True, **kwargs)
        return real_load(f, *args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = real_load


def safe_load(path: str, load: Optional[Callable[[str], object]] = None, verified: bool = False, mapped: bool = False):
    """``load(path)`` (default: torch.load onto the CPU) with fairseq's extra types allowed, after
    checking the file is intact (skipped if ``verified``: its sha256 was just checked against a
    manifest). A refused type or a damaged file ends in one line; so does a file that holds no
    fairseq checkpoint when a custom ``load`` fails on it (fairseq's upgrade of old checkpoints
    indexes whatever torch.load returned). Any other error is re-raised as it is.

    The not-a-checkpoint check re-reads the file with plain torch.load, so it runs only for a custom
    ``load``: after torch.load itself failed, the re-read would fail alike.

    ``mapped``: the file is memory-mapped (``mapping_loads_of``), for loaders that never write the file while
    its tensors live (fairseq's loads: saves go to new files and are renamed into place).
    """
    if not verified:
        check_file_intact(path)
    explain_other_failures = load is not None
    restricted = _weights_only_by_default() if load is not None else contextlib.nullcontext()
    mapping = mapping_loads_of(path) if mapped and is_zip_checkpoint(path) else contextlib.nullcontext()
    with torch.serialization.safe_globals(CHECKPOINT_SAFE_GLOBALS), restricted, mapping:
        try:
            return (load or _torch_load_on_cpu)(path)
        except (EOFError, RuntimeError, pickle.UnpicklingError) as error:
            one_line = unloadable_error(path, error)
            if one_line is None:
                if explain_other_failures:
                    refuse_if_not_a_checkpoint(path)
                raise
            raise one_line from None
        except (KeyError, TypeError, AttributeError, IndexError):
            if explain_other_failures:
                refuse_if_not_a_checkpoint(path)
            raise


def refuse_if_not_a_checkpoint(path: str) -> None:
    """After fairseq failed on a file: one line if the file holds no fairseq checkpoint at all
    (fairseq's upgrade of old checkpoints indexes whatever torch.load returned)."""
    try:
        state = safe_load(path, verified=True)
    except Exception:  # noqa: BLE001 - fairseq's own error stands
        return
    check_is_checkpoint(state, path)


def peek_metadata(path: str) -> Optional[Dict]:
    """``state["moe"]`` of a file, read without loading its tensors (None if unreadable): for error messages."""
    try:
        with torch.serialization.safe_globals(CHECKPOINT_SAFE_GLOBALS):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        meta = state.get("moe") if isinstance(state, dict) else None
        return meta if isinstance(meta, dict) else None
    except Exception:  # noqa: BLE001 - only a message depends on it
        return None
