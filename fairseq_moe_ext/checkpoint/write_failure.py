"""Why a checkpoint could not be written, said the same way by every writer.

Every writer of checkpoint files reports a failed write through ``cannot_write``: fairseq-train's own
saves through the plugin (``fairseq_integration/saving.py``) and the checkpoint tool's merge, reshard
and upcycle (``staging.write_all_or_nothing``, which an import or export tool uses as well). The
report is one line with one cause and the fix for that cause.

A full disk does not always say so. ``torch.save`` to a path reports the short write as its stream
writer's internal check ("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
and ``torch.save`` to a Python file keeps the ``OSError`` only as that RuntimeError's context. So the
errno is looked for along the exception's chain, and where there is none the filesystem is asked:
no block left to an ordinary user means it is full. Nothing here imports torch or fairseq.
"""

import errno
import os
from typing import Iterable, Optional

from .errors import CheckpointWriteError

FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}
# What torch's zip stream writer raises when the bytes it wrote did not all reach the file.
TORCH_WRITER_FAILURES = ("inline_container.cc", "PytorchStreamWriter failed")


def os_error_in(error: BaseException) -> Optional[OSError]:
    """The first OSError of a file operation with an errno along ``error``'s cause/context chain
    (``error`` itself first); a connection's error (a peer worker gone) is none."""
    seen = set()
    while error is not None and id(error) not in seen:
        if (
            isinstance(error, OSError)
            and error.errno is not None
            and not isinstance(error, (ConnectionError, TimeoutError))
        ):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def is_write_failure(error: BaseException) -> bool:
    """A file operation's OSError (here or along the chain), or torch's stream writer reporting a
    short write."""
    return os_error_in(error) is not None or any(marker in str(error) for marker in TORCH_WRITER_FAILURES)


def filesystem_is_full(directory: str) -> bool:
    """No block left to an ordinary user on ``directory``'s filesystem (root may still have the
    reserved ones, but a write of root's that failed had used those up too)."""
    try:
        return os.statvfs(directory).f_bavail == 0
    except OSError:
        return False


def cannot_write(error: BaseException, what: str, directory: str, writable_fix: str, then: str) -> CheckpointWriteError:
    """The one-line report of ``error``, raised while writing ``what`` into ``directory``. Ask it
    before removing what the failed write left (that frees the space it would look at).
    ``writable_fix``: how to give the writer a directory it may write to; ``then``: what follows the fix."""
    found = os_error_in(error)
    code = found.errno if found is not None else None
    if code not in FULL and code not in NOT_WRITABLE and filesystem_is_full(directory):
        code = errno.ENOSPC
    if code in FULL:
        return CheckpointWriteError(
            f"cannot write {what}: {FULL[code]} on the filesystem that holds {directory}; free space there, {then}"
        )
    if code in NOT_WRITABLE:
        return CheckpointWriteError(
            f"cannot write {what}: {directory} is not writable ({os.strerror(code).lower()}); {writable_fix}, {then}"
        )
    reason = " ".join(str(error).split()) or type(error).__name__
    return CheckpointWriteError(
        f"cannot write {what} into {directory} ({reason}); check that filesystem (its free space, its health), {then}"
    )


def remove_new_partial_files(directory: str, before: Iterable[str], endings: Iterable[str]) -> None:
    """Remove the files a failed write left half-written: names ending in one of ``endings`` (the
    ``.tmp`` names every writer writes before its rename) that were not in ``directory`` ``before``."""
    endings, before = tuple(endings), set(before)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name not in before and name.endswith(endings):
            try:
                os.remove(os.path.join(directory, name))
            except OSError:
                pass
