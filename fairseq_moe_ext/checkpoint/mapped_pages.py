"""Giving back the pages of memory-mapped checkpoint files a load has finished reading.

A checkpoint file loaded with ``torch.load(mmap=True)`` is one private mapping of the file: its tensors' bytes are
read from disk when first touched and then stay resident in the process until the mapping goes, although the
kernel could read them again from the file at any time. A load for generation reads each expert once (to cast it
to the dtype it runs in, or to gather it into one tensor); without giving the pages back the process would hold
the file's bytes beside the copy it keeps. ``release`` drops them (``madvise(MADV_DONTNEED)`` on every private
mapping of the named files): a page touched again is read again from the file, with the same bytes, as long as
nothing wrote into it, which is why only loads that never write into a loaded state call it. Linux only; elsewhere
nothing is given back.
"""

import ctypes
import ctypes.util
import os
from typing import Iterable, List, Tuple

MADV_DONTNEED = 4
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc.madvise


def private_mappings(paths: Iterable[str]) -> List[Tuple[int, int]]:
    """The (start, end) of every private mapping of ``paths`` in this process (none where /proc is missing)."""
    wanted = {os.path.realpath(p) for p in paths}
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[1].endswith("p") and fields[5].rstrip("\n") in wanted:
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    found.append((start, end))
    except OSError:
        return []
    return found


def release(paths: Iterable[str]) -> int:
    """Drop this process's resident pages of the private mappings of ``paths``; the bytes released from."""
    paths = list(paths)
    if not paths or not os.path.exists("/proc/self/maps"):
        return 0
    return release_ranges((path, start, end) for path in paths for start, end in private_mappings([path]))


def release_ranges(mappings: Iterable[Tuple[str, int, int]]) -> int:
    """``release`` for mappings named by (path, start, end), e.g. only those one load created: a mapping made
    earlier (a model loaded before from the same file, whose pages may have been written since) is left alone. A
    range is released only while it still maps that file: once torch unmapped it, malloc may have reused it."""
    mappings = list(mappings)
    live = set(private_mappings({path for path, _, _ in mappings}))
    madvise, released = _madvise(), 0
    for _, start, end in mappings:
        if (start, end) in live and madvise(start, end - start, MADV_DONTNEED) == 0:
            released += end - start
    return released
