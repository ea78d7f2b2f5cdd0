"""Hugging Face ``pytorch_model*.bin`` shards (``save_pretrained(safe_serialization=False)``: each a state
dict that ``torch.save`` wrote), read the way ``import-hf`` reads safetensors files.

Opening a shard reads its pickle only (``one_read.load_skipping(tensors=False)``: the restricted types
of ``safe_load``, every tensor left on the ``meta`` device), which gives every tensor's dtype and shape
for the checks made before anything is written. ``read(name)`` then loads the shard that holds
``name`` in one read (each tensor's CRC-32 checked as it is read) and keeps it until a tensor of
another shard is asked for: one shard in memory at a time, so ``import-hf`` asks for the tensors of
an output file grouped by the shard that holds them.
"""

from typing import Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointSetError
from ..one_read import load_skipping


class _Current:
    """The one shard held in memory: (path, {name: tensor})."""

    loaded: Optional[Tuple[str, Dict[str, torch.Tensor]]] = None


class TorchBinFile:
    """The tensors of one ``.bin`` shard: ``entries`` {name: (dtype, shape)}, ``read(name)``."""

    def __init__(self, path: str):
        self.path = path
        self.entries: Dict[str, Tuple[torch.dtype, List[int]]] = {
            name: (tensor.dtype, list(tensor.shape)) for name, tensor in self._tensors(tensors=False).items()
        }

    def _tensors(self, tensors: bool) -> Dict[str, torch.Tensor]:
        state = load_skipping(self.path, skip=(), tensors=tensors)
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

    def shape(self, name: str) -> List[int]:
        return self.entries[name][1]

    def read(self, name: str) -> torch.Tensor:
        if _Current.loaded is None or _Current.loaded[0] != self.path:
            _Current.loaded = None  # the previous shard goes before this one is read
            _Current.loaded = (self.path, self._tensors(tensors=True))
        return _Current.loaded[1][name]

    @staticmethod
    def release() -> None:
        _Current.loaded = None
