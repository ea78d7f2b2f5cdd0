"""Hugging Face ``pytorch_model*.bin`` shards (``save_pretrained(safe_serialization=False)``, and transformers'
NLLB-MoE converter, which wrote the hub's ``facebook/nllb-moe-54b``: each a state dict that ``torch.save`` wrote),
read the way ``import-hf`` reads safetensors files: each tensor on its own, by seeking.

Opening a shard reads its pickle only (``one_read.OpenCheckpoint``: the restricted types of ``safe_load``, every
tensor left on the ``meta`` device), which gives every tensor's dtype and shape for the checks made before
anything is written. ``read(name)`` then reads that tensor's archive member alone (its CRC-32 checked as it is
read). The hub's shards hold some experts of every MoE layer each, so every output rank file needs every shard:
read so, each byte of a shard is read once for all the output files, and memory holds what is being written, not
a shard. A legacy (pre-zip) ``.bin`` cannot be read in parts: it is loaded whole when one of its tensors is asked
for and kept until a tensor of another shard is (one shard in memory at a time; ``import-hf`` asks for the tensors
of an output file grouped by the shard that holds them).
"""

from typing import Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointSetError
from ..one_read import NotOneRead, OpenCheckpoint, load_skipping


class _Current:
    """The one legacy shard held in memory: (path, {name: tensor})."""

    loaded: Optional[Tuple[str, Dict[str, torch.Tensor]]] = None


class TorchBinFile:
    """The tensors of one ``.bin`` shard: ``entries`` {name: (dtype, shape)}, ``read(name)``."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._opened: Optional[OpenCheckpoint] = OpenCheckpoint(path)
            state = self._checked(self._opened.state)
        except NotOneRead:
            self._opened, state = None, self._legacy_tensors(tensors=False)
        self._meta = state if self._opened is not None else {}
        self.entries: Dict[str, Tuple[torch.dtype, List[int]]] = {
            name: (tensor.dtype, list(tensor.shape)) for name, tensor in state.items()
        }

    def _checked(self, state) -> Dict[str, torch.Tensor]:
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise CheckpointSetError(
                f"{self.path} is not a Hugging Face weights file (a dict of tensor names to tensors): restore it "
                f"from the checkpoint's source (nothing was written)"
            )
        return state

    def _legacy_tensors(self, tensors: bool) -> Dict[str, torch.Tensor]:
        return self._checked(load_skipping(self.path, skip=(), tensors=tensors))

    def shape(self, name: str) -> List[int]:
        return self.entries[name][1]

    def read(self, name: str) -> torch.Tensor:
        if self._opened is not None:
            return self._opened.materialise(self._meta[name])
        if _Current.loaded is None or _Current.loaded[0] != self.path:
            _Current.loaded = None  # the previous shard goes before this one is read
            _Current.loaded = (self.path, self._legacy_tensors(tensors=True))
        return _Current.loaded[1][name]

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """``out`` (contiguous, the tensor's shape) filled with ``name``'s values, cast to its dtype; from a zip shard
        straight from the tensor's member (no other copy where the dtypes agree)."""
        if self._opened is not None:
            self._opened.read_into(self._meta[name], out)
        else:
            out.copy_(self.read(name))

    def release(self) -> None:
        """Let go of the legacy shard held, if it is this one (a zip shard's tensors are held by their reader alone)."""
        if _Current.loaded is not None and _Current.loaded[0] == self.path:
            _Current.loaded = None

    def close(self) -> None:
        self.release()
        if self._opened is not None:
            self._opened.close()
