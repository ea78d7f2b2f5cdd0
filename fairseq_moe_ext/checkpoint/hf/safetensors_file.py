"""Safetensors files, written and read with torch alone (the ``safetensors`` package is a test-only
dependency here: the tests read what this writes with it).

The format: an 8-byte little-endian unsigned header length N, N bytes of JSON (``{name: {"dtype",
"shape", "data_offsets": [begin, end]}}`` plus an optional ``"__metadata__"`` of strings; offsets are
relative to the end of the header), then the tensors' raw little-endian bytes, back to back.

Reading opens a file, checks its header against the file's size (a truncated copy is refused before
any tensor is read) and reads one tensor at a time by seeking, so a reader holds only the tensors it
asked for, never the whole file.
"""

import json
import os
import struct
import sys
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..errors import CheckpointSetError
from ..one_read import byte_view

# fmt: off
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
# fmt: on
NAMES = {dtype: name for name, dtype in DTYPES.items()}
# A header is a few hundred bytes per tensor; one larger than this is not a safetensors header.
MAX_HEADER_BYTES = 100 << 20


def _check_byte_order():
    if sys.byteorder != "little":  # raw bytes are written as they lie in memory
        raise CheckpointSetError(
            "safetensors files are little-endian; this machine is big-endian: convert on a "
            "little-endian machine (nothing was written)"
        )


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def write_safetensors(
    path: str, tensors: Iterable[Tuple[str, torch.Tensor]], metadata: Optional[Dict[str, str]] = None
) -> None:
    """Write ``tensors`` (name, tensor) in the given order to ``path``."""
    _check_byte_order()
    tensors = list(tensors)
    header, offset = {}, 0
    for name, tensor in tensors:
        if tensor.dtype not in NAMES:
            raise CheckpointSetError(
                f"{name} has dtype {tensor.dtype}, which safetensors files here do not hold: "
                f"cast the checkpoint to float32, float16 or bfloat16 (nothing was written)"
            )
        size = tensor_bytes(tensor)
        header[name] = {
            "dtype": NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors package writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, tensor in tensors:
            if tensor.numel():
                flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                # torch's own zero-copy buffer of exactly these bytes (an expert is a view whose storage is
                # the whole stack, so the storage's bytes would be the wrong ones)
                f.write(memoryview(flat.numpy()))
        f.flush()
        os.fsync(f.fileno())


class SafetensorsFile:
    """The header of one safetensors file, checked; ``read(name)`` loads one tensor."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
                if length is None or length > min(size - 8, MAX_HEADER_BYTES):
                    self._damaged("its header length runs past the end of the file")
                header = json.loads(f.read(length).decode("utf-8"))
        except (OSError, ValueError) as e:
            if isinstance(e, CheckpointSetError):
                raise
            raise CheckpointSetError(
                f"cannot read {path}: {' '.join(str(e).split())}; restore the file from the "
                f"checkpoint's source (nothing was written)"
            ) from None
        if not isinstance(header, dict):
            self._damaged("its header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + length
        self.entries: Dict[str, Tuple[torch.dtype, List[int], int, int]] = {}
        for name, entry in header.items():
            self.entries[name] = self._entry(name, entry)
        end = max((e[3] for e in self.entries.values()), default=0)
        if self.data_start + end > size:
            self._damaged(f"its header describes {self.data_start + end} bytes but the file has {size} (truncated)")

    def _entry(self, name, entry):
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            self._damaged(f"the header entry of {name} is not dtype/shape/data_offsets of a supported dtype")
        count = 1
        for d in shape:
            count *= d
        if (
            min(shape, default=0) < 0
            or not 0 <= begin <= end
            or end - begin != count * torch.empty(0, dtype=dtype).element_size()
        ):
            self._damaged(f"the header entry of {name} gives {end - begin} bytes for shape {shape}")
        return dtype, shape, begin, end

    def _damaged(self, why: str):
        raise CheckpointSetError(
            f"{self.path} is not a complete safetensors file: {why}; download or copy it again (nothing was written)"
        )

    def shape(self, name: str) -> List[int]:
        return self.entries[name][1]

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """``out`` (contiguous, the tensor's shape) filled with ``name``'s values, cast to its dtype (read straight
        into it where the dtypes agree: no other copy)."""
        dtype, _, begin, end = self.entries[name]
        if dtype != out.dtype or not out.numel():
            out.copy_(self.read(name))
            return
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            count = f.readinto(byte_view(out))
        if count != end - begin:
            self._damaged(f"{name} ends past the end of the file")

    def release(self) -> None:
        """Nothing to let go of: each tensor is read by seeking and held by its reader alone."""

    close = release

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            raw = f.read(end - begin)
        if len(raw) != end - begin:
            self._damaged(f"{name} ends past the end of the file")
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
