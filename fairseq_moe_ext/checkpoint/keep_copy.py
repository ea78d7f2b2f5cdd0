"""A second name for a file that keeps its current bytes while the first name is replaced.

The ``.prev`` generation of a set is a hard link where the filesystem has them (free, instant).
gcsfuse, blobfuse and some SMB/NFS mounts refuse ``link(2)``; there the file is copied instead,
with the same crash-safety: the copy goes to ``<target>.tmp``, is flushed to disk, and only then
renamed to ``target``, so ``target`` is always absent, the old whole file, or the new whole file.
"""

import errno
import logging
import os
import shutil

logger = logging.getLogger(__name__)

# What link(2) answers where the filesystem (or the mount) has no hard links, or not across the
# two names: fall back to copying. Anything else (ENOSPC, EACCES, ENOENT ...) is a real failure.
NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS})


def keep_as(source: str, target: str) -> str:
    """Make ``target`` hold ``source``'s current bytes, atomically; returns "link" or "copy"."""
    tmp = target + ".tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    try:
        os.link(source, tmp)
        how = "link"
    except OSError as error:
        if error.errno not in NO_HARD_LINKS:
            raise
        logger.info(
            f"no hard links in {os.path.dirname(target) or '.'} ({error.strerror}): copying "
            f"{os.path.basename(source)} to {os.path.basename(target)} instead"
        )
        _durable_copy(source, tmp)
        how = "copy"
    os.replace(tmp, target)
    return how


def _durable_copy(source: str, destination: str) -> None:
    try:
        with open(source, "rb") as src, open(destination, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
            dst.flush()
            os.fsync(dst.fileno())
    except BaseException:
        if os.path.lexists(destination):
            os.remove(destination)
        raise
