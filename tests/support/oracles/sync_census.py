"""Count, on CPU, the operations that would make a GPU wait for the host or the host for the GPU.

On CUDA these stall the stream: reading a value on the host (``.item()``, ``int(t)``, ``bool(t)``,
``.tolist()``, ``.cpu()``, ``.numpy()``), ops whose output shape depends on the data (``nonzero``,
boolean indexing, ``masked_select``, ``unique``, ``bincount`` (it reads the max to size its output),
``repeat_interleave`` without ``output_size``), and copies of host data to the device
(``torch.tensor(list)``, ``new_tensor``: a pageable copy the host waits for). On CPU none of them
costs anything, but all can be seen: a ``TorchDispatchMode`` sees every aten op, and the host
reads that a CPU tensor serves without one (``tolist``, ``cpu``, ``numpy``) are wrapped for the
duration.
"""

import contextlib
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Ops that are a host sync (or a data-dependent size, which is one) whatever their arguments.
# fmt: off
ALWAYS = {
    aten._local_scalar_dense.default: "item",
    aten.nonzero.default: "nonzero",
    aten.bincount.default: "bincount",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.lift_fresh.default: "host-to-device copy",
    aten.lift_fresh_copy.default: "host-to-device copy",
}
# fmt: on
HOST_READS = ("tolist", "cpu", "numpy")


def _where() -> str:
    """The innermost frame of this project that caused the op, for the failure message."""
    for frame in reversed(traceback.extract_stack()):
        if "fairseq_moe_ext" in frame.filename:
            return f"{frame.filename.split('fairseq_moe_ext/')[-1]}:{frame.lineno} {frame.line}"
    return "outside fairseq_moe_ext"


class SyncCensus(TorchDispatchMode):
    """``with SyncCensus() as census: ...`` then ``census.count``, ``census.sites``."""

    def __init__(self):
        super().__init__()
        self.sites = []
        self._patches = contextlib.ExitStack()

    @property
    def count(self) -> int:
        return len(self.sites)

    def summary(self) -> str:
        return "\n".join(f"{n} x {site}" for site, n in Counter(self.sites).items()) or "none"

    def _record(self, what):
        self.sites.append(f"{what} at {_where()}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ALWAYS:
            self._record(ALWAYS[func])
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self._record("boolean indexing")
        elif (
            func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
            and kwargs.get("output_size") is None
        ):
            self._record("repeat_interleave without output_size")
        return func(*args, **kwargs)

    def __enter__(self):
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)

            def read(tensor, *args, _original=original, _name=name, **kwargs):
                self._record(_name)
                return _original(tensor, *args, **kwargs)

            self._patches.callback(setattr, torch.Tensor, name, original)
            setattr(torch.Tensor, name, read)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()
