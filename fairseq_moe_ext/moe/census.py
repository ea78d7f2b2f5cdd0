"""Count, per stretch of code, the collectives it issues and the points where a GPU would wait for the host.

An instrument, not part of the layer (imported by no module of the package): the census test
(tests/core/test_sync_census.py, tests/core/test_collective_census.py), the layer benchmark
(benchmarks/moe_layer.py) and the GPU one-shot (benchmarks/device/oneshot_census.py) count with it.

Host syncs. On CUDA these stall the stream: reading a value on the host (``.item()``, ``int(t)``,
``bool(t)``, ``.tolist()``, ``.cpu()``, ``.numpy()``), ops whose output shape depends on the data
(``nonzero``, boolean indexing, ``masked_select``, ``unique``, ``bincount`` (it reads the max to size
its output), ``repeat_interleave`` without ``output_size``), and copies of host data to the device
(``torch.tensor(list)``, ``new_tensor``: a pageable copy the host waits for). On CPU none of them costs
anything, but all can be seen: a ``TorchDispatchMode`` sees every aten op, and the host reads that a
CPU tensor serves without one (``tolist``, ``cpu``, ``numpy``) are wrapped for the duration.

Collectives. Every function of ``torch.distributed`` that starts one (``COLLECTIVES``) is wrapped for
the duration, so what is counted is what reaches torch, whoever issues it (the layer, fairseq, FSDP2).
With ``timed=True`` each is timed from the host, the device synchronised before and after (the time a
collective holds the stream, for the GPU one-shot; timing changes the overlap it measures, so counts
are taken untimed).

Both record only what the thread that opened the census does: several censuses may be open at once on
the threads of a thread world (tests/support/launch/thread_world.py), one per rank.
"""

import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
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
# torch.distributed's functions that start a collective (those this torch has are wrapped).
# fmt: off
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all_single", "all_to_all",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "gather", "scatter",
    "barrier", "all_gather_object", "broadcast_object_list", "send", "recv", "isend", "irecv",
)
# fmt: on


def where() -> str:
    """The innermost frame of this project that caused the op, for the failure message."""
    for frame in reversed(traceback.extract_stack()):
        if "fairseq_moe_ext" in frame.filename and not frame.filename.endswith("moe/census.py"):
            return f"{frame.filename.split('fairseq_moe_ext/')[-1]}:{frame.lineno} {frame.line}"
    return "outside fairseq_moe_ext"


@dataclass
class Collective:
    op: str  # torch.distributed's function, "all_to_all_single"
    group_size: int
    nbytes: int  # of the tensors handed to it (inputs and outputs)
    site: str  # where in the package it was issued
    seconds: float = 0.0  # with timed=True


class _Wrapped:
    """The one set of wrappers over torch: installed while any census is open, each call recorded by the
    censuses of the calling thread."""

    lock = threading.Lock()
    open = {}  # thread id -> [census], innermost last
    originals = []  # (owner, name, original)

    @classmethod
    def enter(cls, census) -> None:
        with cls.lock:
            if not cls.open:
                cls._install()
            cls.open.setdefault(threading.get_ident(), []).append(census)

    @classmethod
    def exit(cls, census) -> None:
        with cls.lock:
            mine = cls.open[threading.get_ident()]
            mine.remove(census)
            if not mine:
                del cls.open[threading.get_ident()]
            if not cls.open:
                for owner, name, original in reversed(cls.originals):
                    setattr(owner, name, original)
                cls.originals.clear()

    @classmethod
    def mine(cls):
        return list(cls.open.get(threading.get_ident(), ()))

    @classmethod
    def _install(cls) -> None:
        for name in HOST_READS:
            cls._wrap(torch.Tensor, name, cls._host_read(name, getattr(torch.Tensor, name)))
        for name in COLLECTIVES:
            if hasattr(dist, name):
                cls._wrap(dist, name, cls._collective(name, getattr(dist, name)))

    @classmethod
    def _wrap(cls, owner, name, wrapper) -> None:
        cls.originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    @classmethod
    def _host_read(cls, name, original):
        def read(tensor, *args, **kwargs):
            for census in cls.mine():
                census.record_sync(name)
            return original(tensor, *args, **kwargs)

        return read

    @classmethod
    def _collective(cls, name, original):
        def collective(*args, **kwargs):
            censuses = cls.mine()
            if not censuses:
                return original(*args, **kwargs)
            group = kwargs.get("group")
            tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, list) else [a])]
            tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
            timed = any(c.timed for c in censuses)
            if timed:
                _synchronise(tensors)
            started = time.perf_counter()
            result = original(*args, **kwargs)
            if timed:
                _synchronise(tensors)
            record = Collective(
                name,
                1 if not dist.is_initialized() and group is None else dist.get_world_size(group),
                sum(t.numel() * t.element_size() for t in tensors),
                where(),
                time.perf_counter() - started if timed else 0.0,
            )
            for census in censuses:
                census.collectives.append(record)
            return result

        return collective


def _synchronise(tensors) -> None:
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


class Census(TorchDispatchMode):
    """``with Census() as census: ...`` then ``census.count`` / ``census.sites`` (host syncs) and
    ``census.collectives`` (a ``Collective`` each, in the order issued)."""

    def __init__(self, timed: bool = False):
        super().__init__()
        self.sites = []
        self.collectives = []
        self.timed = timed

    # Host syncs.
    @property
    def count(self) -> int:
        return len(self.sites)

    def summary(self) -> str:
        return "\n".join(f"{n} x {site}" for site, n in Counter(self.sites).items()) or "none"

    def record_sync(self, what) -> None:
        self.sites.append(f"{what} at {where()}")

    # Collectives.
    @property
    def collective_count(self) -> int:
        return len(self.collectives)

    def collective_summary(self) -> str:
        counted = Counter(f"{c.op} at {c.site}" for c in self.collectives)
        return "\n".join(f"{n} x {site}" for site, n in counted.items()) or "none"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ALWAYS:
            self.record_sync(ALWAYS[func])
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.record_sync("boolean indexing")
        elif (
            func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
            and kwargs.get("output_size") is None
        ):
            self.record_sync("repeat_interleave without output_size")
        return func(*args, **kwargs)

    def __enter__(self):
        _Wrapped.enter(self)
        try:
            return super().__enter__()
        except BaseException:
            _Wrapped.exit(self)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _Wrapped.exit(self)
