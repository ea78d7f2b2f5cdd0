"""Loading a torch checkpoint file in one read, leaving parts of it unread: ``load_skipping``.

``torch.load`` reads every tensor a file pickles, and ``safe_load`` first reads the whole file once
more to check its CRC-32s. A fairseq ``moe``/``nllb``-branch file also carries
``last_optimizer_state`` (Adam's two moments for every parameter it holds, plus their fp16 scales),
which an import never uses: loading it costs memory and, with the CRC pass, reading the file twice.

Here the archive is opened with Python's ``zipfile`` through a reader that counts what it reads
(``CountingReader``: every read's offset and length, and a callback for a progress bar). Only the
pickle is read first, and unpickled by torch's weights-only unpickler (the same restricted types as
``safe_load``: ``CHECKPOINT_SAFE_GLOBALS``) with every storage on the ``meta`` device. Then each tensor
outside the skipped top-level keys is read from its archive member, once, and ``zipfile`` checks
that member's CRC-32 as it reads it; the skipped keys' tensors are never read and are dropped. So
each byte of a file is read at most once, the members it skips not at all, and a damaged member is
still refused (in the one line ``safe_load`` uses). Legacy (pre-zip) files go through ``safe_load``.

``OpenCheckpoint`` is that reader kept open: the pickle read once, each tensor read when asked for (or straight
into a tensor of the caller's, ``read_into``). ``import-hf`` reads Hugging Face ``.bin`` shards so, each tensor
once for all the output files it writes.
"""

import io
import pickle
import sys
import zipfile
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import _weights_only_unpickler

from .errors import DamagedCheckpointError, load_another
from .safe_load import CHECKPOINT_SAFE_GLOBALS, check_file_intact, safe_load, unloadable_error

CHUNK = 16 << 20


class CountingReader(io.RawIOBase):
    """A file opened for reading that records ``(offset, length)`` of every read and reports each."""

    def __init__(self, path: str, on_read: Optional[Callable[[int], None]] = None):
        super().__init__()
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
        self.reads: List[Tuple[int, int]] = []
        self._on_read = on_read

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=io.SEEK_SET):
        return self._file.seek(offset, whence)

    def tell(self):
        return self._file.tell()

    def readinto(self, buffer):
        start = self._file.tell()
        count = self._file.readinto(buffer)
        if count:
            self.reads.append((start, count))
            if self._on_read is not None:
                self._on_read(count)
        return count

    def close(self):
        self._file.close()
        super().close()

    @property
    def bytes_read(self) -> int:
        return sum(length for _, length in self.reads)


def _damaged(path: str, error: BaseException) -> DamagedCheckpointError:
    text = " ".join(str(error).split()) or type(error).__name__
    return DamagedCheckpointError(
        f"{path} is damaged or incomplete ({text}): it was truncated or corrupted after it was written; "
        f"{load_another()}"
    )


def load_skipping(
    path: str,
    skip: Iterable[str] = ("last_optimizer_state",),
    on_read: Optional[Callable[[int], None]] = None,
    reads: Optional[List[Tuple[int, int]]] = None,
    tensors: bool = True,
) -> Dict:
    """The checkpoint at ``path`` without its top-level keys ``skip``, whose tensors are never read.
    ``on_read(n)`` hears of every read; ``reads`` (a list) receives each read's ``(offset, length)``.
    ``tensors=False``: read the pickle only, every tensor left on the ``meta`` device (names, shapes, dtypes)."""
    try:
        opened = OpenCheckpoint(path, on_read)
    except NotOneRead:  # a legacy (pre-zip) pickle, or bytes swapped: torch reads it all
        state = safe_load(path, verified=True)
        return {k: v for k, v in state.items() if k not in set(skip)} if isinstance(state, dict) else state
    try:
        state = opened.state
        if not isinstance(state, dict):
            return state
        state = {k: v for k, v in state.items() if k not in set(skip)}
        held: Dict[str, torch.UntypedStorage] = {}
        return _map_tensors(state, lambda t: opened.materialise(t, held)) if tensors else state
    except (zipfile.BadZipFile, EOFError, ValueError) as error:
        raise _damaged(path, error) from None
    finally:
        if reads is not None:
            reads.extend(opened.reader.reads)
        opened.close()


class NotOneRead(Exception):
    """A file ``OpenCheckpoint`` does not read in parts: a legacy (pre-zip) pickle, or one whose bytes torch swaps."""


class OpenCheckpoint:
    """A torch zip checkpoint opened once: its pickle read (``state``, every tensor on the ``meta`` device, the
    restricted types of ``safe_load``), each tensor's bytes read from its archive member when ``materialise``d,
    every read counted (``reader``): tensors asked for once each are read once each, and tensors never asked for
    not at all."""

    def __init__(self, path: str, on_read: Optional[Callable[[int], None]] = None):
        self.path, self.reader = path, CountingReader(path, on_read)
        try:
            try:
                self.archive = zipfile.ZipFile(self.reader)
            except zipfile.BadZipFile:
                check_file_intact(path)  # empty or garbage: its one line; a legacy pickle passes
                raise NotOneRead(path) from None
            self.state, self._storages, self._root = _unpickle(self.archive, path)
        except (zipfile.BadZipFile, EOFError, ValueError) as error:
            self.close()
            raise _damaged(path, error) from None
        except BaseException:
            self.close()
            raise
        self._key_of = {storage._cdata: key for key, (storage, _) in self._storages.items()}

    def materialise(self, tensor: torch.Tensor, held: Optional[Dict[str, torch.UntypedStorage]] = None) -> torch.Tensor:
        """``tensor`` (a ``meta`` tensor of ``state``) with its bytes, read from its member (CRC-32 checked). ``held``:
        storages already read, by key (tensors sharing a storage read it once); None: read it, keep nothing."""
        key = self._key_of[tensor.untyped_storage()._cdata]
        storage = None if held is None else held.get(key)
        if storage is None:
            try:
                storage = _read_member(self.archive, self._root + "data/" + key, self._storages[key][0].nbytes())
            except (zipfile.BadZipFile, EOFError, ValueError) as error:
                raise _damaged(self.path, error) from None
            if held is not None:
                held[key] = storage
        return torch.empty(0, dtype=tensor.dtype).set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())

    def read_into(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous, ``tensor``'s shape) with ``tensor``'s values: straight from its member when
        ``tensor`` is the whole of its storage in ``out``'s dtype (no other copy is made), else through
        ``materialise`` (cast or cut from a larger storage)."""
        key = self._key_of[tensor.untyped_storage()._cdata]
        whole = self._storages[key][0].nbytes() == out.numel() * out.element_size()
        if not (whole and tensor.dtype == out.dtype and tensor.storage_offset() == 0 and tensor.is_contiguous()):
            out.copy_(self.materialise(tensor))
            return
        if out.numel():
            try:
                _read_member_into(self.archive, self._root + "data/" + key, byte_view(out))
            except (zipfile.BadZipFile, EOFError, ValueError) as error:
                raise _damaged(self.path, error) from None

    def close(self) -> None:
        archive = getattr(self, "archive", None)
        if archive is not None:
            archive.close()
        self.reader.close()


def _unpickle(archive: zipfile.ZipFile, path: str):
    """(state with every tensor on the meta device, {storage key: (meta storage, dtype)}, the archive's root)."""
    names = archive.namelist()
    pickled = next((n for n in names if n.endswith("/data.pkl") and n.count("/") == 1), None)
    if pickled is None:
        raise DamagedCheckpointError(f"{path} holds no data.pkl: not a torch checkpoint; {load_another()}")
    root = pickled[: -len("data.pkl")]
    if root + "byteorder" in names and archive.read(root + "byteorder").decode() != sys.byteorder:
        raise NotOneRead(path)  # torch swaps the bytes; rare enough to read it all
    storages: Dict[str, Tuple[torch.UntypedStorage, torch.dtype]] = {}

    def persistent_load(saved_id):
        typename, storage_type, key, _location, numel = saved_id
        if typename not in ("storage", b"storage"):
            raise pickle.UnpicklingError(f"persistent id {typename!r} in {path}: not a torch storage")
        key = key.decode() if isinstance(key, bytes) else key
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        if key not in storages:
            size = numel * torch._utils._element_size(dtype)
            storages[key] = (torch.UntypedStorage(size, device="meta"), dtype)
        storage, _ = storages[key]
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    with torch.serialization.safe_globals(CHECKPOINT_SAFE_GLOBALS):
        try:
            unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(archive.read(pickled)), encoding="utf-8")
            unpickler.persistent_load = persistent_load
            state = unpickler.load()
        except (EOFError, RuntimeError, pickle.UnpicklingError) as error:
            one_line = unloadable_error(path, error)
            raise (one_line or error) from None
    return state, storages, root


def _read_member(archive: zipfile.ZipFile, name: str, size: int) -> torch.UntypedStorage:
    """The member's bytes as a storage, read once; zipfile checks its CRC-32 when the read reaches its end."""
    buffer = bytearray(size)
    _read_member_into(archive, name, memoryview(buffer))
    if not size:
        return torch.UntypedStorage(0)
    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


def _read_member_into(archive: zipfile.ZipFile, name: str, view: memoryview) -> None:
    """The member's bytes into ``view`` (its size), once; zipfile checks the CRC-32 when the read reaches its end."""
    size = len(view)
    with archive.open(name) as member:
        done = 0
        while done < size:
            count = member.readinto(view[done : done + CHUNK])
            if not count:
                raise EOFError(f"{name} ends after {done} of {size} bytes")
            done += count
        if member.read(1):
            raise ValueError(f"{name} holds more than its {size} bytes")


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _map_tensors(value, function):
    if isinstance(value, torch.Tensor):
        return function(value) if value.device.type == "meta" else value
    if isinstance(value, dict):
        for key, item in value.items():  # in place: an OrderedDict or defaultdict stays what it is
            value[key] = _map_tensors(item, function)
        return value
    if isinstance(value, list):
        return [_map_tensors(v, function) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map_tensors(v, function) for v in value)
    return value
