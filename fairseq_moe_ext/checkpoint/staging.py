"""The checkpoint tool's output appears whole or not at all.

``merge`` and ``reshard`` write into a hidden temporary directory inside the output directory (the
same file system, so the final moves are renames) and move the files into place only once all of
them are written, a set's manifest last. Any failure (no such directory, no permission, a full
disk, an interrupted move) removes what was staged or moved, and is reported as one line
(``write_failure.cannot_write``: a full disk as a full disk); the output directory is left as it was
found, so a rerun can succeed. Every tool that writes checkpoint files (merge, reshard, upcycle, and
any import or export tool) writes them through ``write_all_or_nothing``, and so does every other output of
the plugin (``--moe-routing-stats``, with ``replace=True``: it may replace a file of that name).

Before the work that fills an output starts (loading a set, generating), ``check_output_file`` /
``check_output_directory`` refuse in the same words what the write would meet: a directory where the file
goes, a missing or unwritable directory, a full filesystem.
"""

import errno
import os
import shutil
import tempfile
from typing import Callable, List

from .errors import CheckpointError, CheckpointSetError
from .write_failure import cannot_write, filesystem_is_full

STAGING_PREFIX = ".moe-ckpt-staging-"


def check_output_directory(output_dir: str, what: str) -> None:
    """Before any work: ``output_dir`` is a directory this process can create files in, on a filesystem
    with space left; else the one line the write would end with (``what`` names the output)."""
    output_dir = output_dir or "."
    if not os.path.isdir(output_dir):
        raise _not_a_directory(what, output_dir)
    if filesystem_is_full(output_dir):
        raise _cannot_write(what, output_dir, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    try:
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=output_dir)
        os.rmdir(staging)
    except OSError as e:
        raise _cannot_write(what, output_dir, e) from None


def check_output_file(path: str, what: str) -> None:
    """``check_output_directory`` for the directory of ``path``, which must not be a directory itself."""
    if os.path.isdir(path):
        raise CheckpointSetError(
            f"cannot write {what}: {path} is a directory; name a file inside it, e.g. "
            f"{os.path.join(path, 'out.json')} (nothing was written)"
        )
    check_output_directory(os.path.dirname(path), what)


def write_all_or_nothing(
    output_dir: str, what: str, write: Callable[[str], List[str]], replace: bool = False
) -> List[str]:
    """Call ``write(staging_dir)``, which writes files there and returns their names in the order
    they may appear (a manifest last); move them into ``output_dir``. ``what`` names the output in
    messages; ``replace``: a file of the same name is replaced (else the write is refused). Returns
    the final paths."""
    output_dir = output_dir or "."
    if not os.path.isdir(output_dir):
        raise _not_a_directory(what, output_dir)
    try:
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=output_dir)
    except OSError as e:
        raise _cannot_write(what, output_dir, e) from None
    try:
        names = write(staging)
        return _move_into_place(staging, output_dir, names, replace)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        if isinstance(e, CheckpointError):
            raise
        raise _cannot_write(what, output_dir, e) from None  # asked before the staging is removed
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _not_a_directory(what: str, output_dir: str) -> CheckpointSetError:
    """The output directory is missing, or it (or a directory above it) is a file."""
    existing = output_dir
    while existing and not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if existing and os.path.lexists(existing) and not os.path.isdir(existing):
        return CheckpointSetError(
            f"cannot write {what}: {existing} is a file, not a directory; choose an output name inside a directory "
            f"(nothing was written)"
        )
    return CheckpointSetError(
        f"cannot write {what}: the output directory {output_dir} does not exist; create it first, or choose another "
        f"output name (nothing was written)"
    )


def _move_into_place(staging: str, output_dir: str, names: List[str], replace: bool = False) -> List[str]:
    moved = []
    try:
        for name in names:
            target = os.path.join(output_dir, name)
            if os.path.lexists(target) and not (replace and os.path.isfile(target)):
                raise CheckpointSetError(f"{target} appeared while writing; choose another output name")
            os.replace(os.path.join(staging, name), target)
            moved.append(target)
    except BaseException:
        for target in reversed(moved):  # a set appears whole or not at all: the manifest came last
            try:
                os.remove(target)
            except OSError:
                pass
        raise
    return moved


def _cannot_write(what: str, output_dir: str, error: BaseException) -> CheckpointError:
    return cannot_write(
        error,
        what,
        output_dir,
        writable_fix="choose an output directory you can write to",
        then="then rerun (nothing was written)",
    )
