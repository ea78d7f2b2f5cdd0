"""W workers of torch.distributed as threads of this process: real collectives between them, no
process group, no worker processes, no fairseq start-up.

``ThreadWorld(W).install(monkeypatch)`` replaces the torch.distributed functions that the plugin
and fairseq's legacy_ddp call (is_initialized, get_world_size, get_rank, get_process_group_ranks,
new_group, all_reduce, all_gather, all_to_all_single, get_backend_config) with ones that exchange tensors between the
threads of ``world.run(fn)``, which calls ``fn(rank)`` on W threads. A thread's rank is
thread-local (``world.as_rank(r)`` lends one to the calling thread), and autograd runs a CPU
backward in the thread that calls it, so the collectives of a backward stay on their rank. A group
is one ``ThreadGroup`` per membership, shared by its members as a process group handle would be.
The plugin's process state keeps the groups it made per rank here, as each worker process would.

Every collective the plugin starts goes through ``moe.comm.collective``, which names it ("all-to-all
of token rows", ...): ``world.collectives`` records ``(rank, name, group ranks)`` for each.
"""

import threading
from collections.abc import MutableMapping
from contextlib import contextmanager

import torch
import torch.distributed as dist

from fairseq_moe_ext.moe import comm
from fairseq_moe_ext.parallel.process_state import STATE, ProcessGroups

TIMEOUT_S = 60


class ThreadGroup:
    def __init__(self, world, ranks):
        self.world, self.ranks = world, tuple(ranks)
        self.sync = threading.Barrier(len(self.ranks), timeout=TIMEOUT_S)
        self.slots = [None] * len(self.ranks)

    def rank(self) -> int:
        return self.ranks.index(self.world.rank())

    def exchange(self, value):
        """Every member's ``value``, in group rank order (every member must call it)."""
        self.slots[self.rank()] = value
        self.sync.wait()
        out = list(self.slots)
        self.sync.wait()  # nobody overwrites a slot before everyone has read them all
        return out

    def __repr__(self):
        return f"ThreadGroup{self.ranks}"


class PerRank(MutableMapping):
    """A dict per rank of the thread world (what a worker process keeps to itself)."""

    def __init__(self, world):
        self.world, self.dicts = world, {}

    def _mine(self):
        return self.dicts.setdefault(self.world.rank(), {})

    def __getitem__(self, key):
        return self._mine()[key]

    def __setitem__(self, key, value):
        self._mine()[key] = value

    def __delitem__(self, key):
        del self._mine()[key]

    def __iter__(self):
        return iter(self._mine())

    def __len__(self):
        return len(self._mine())


class ThreadWorld:
    def __init__(self, size: int):
        self.size = size
        self.local = threading.local()
        self.groups = {}
        self.lock = threading.Lock()
        self.collectives = []  # (rank, what, group ranks), in the order issued
        self.world_group = self.new_group(range(size))

    def rank(self) -> int:
        rank = getattr(self.local, "rank", None)
        if rank is None:
            raise RuntimeError("a collective outside world.run or world.as_rank: this thread has no rank")
        return rank

    @contextmanager
    def as_rank(self, rank: int):
        self.local.rank = rank
        try:
            yield
        finally:
            self.local.rank = None

    def new_group(self, ranks=None, timeout=None, backend=None, **kwargs):
        ranks = tuple(range(self.size)) if ranks is None else tuple(ranks)
        with self.lock:
            if ranks not in self.groups:
                self.groups[ranks] = ThreadGroup(self, ranks)
            return self.groups[ranks]

    def _group(self, group) -> ThreadGroup:
        return self.world_group if group is None else group

    # torch.distributed's functions, as the threads see them.
    def get_world_size(self, group=None):
        return len(self._group(group).ranks)

    def get_rank(self, group=None):
        return self._group(group).rank()

    def get_process_group_ranks(self, group):
        return list(self._group(group).ranks)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        assert op == dist.ReduceOp.SUM and not async_op, "the thread world sums, synchronously"
        values = self._group(group).exchange(tensor.detach().clone())
        total = values[0].clone()
        for value in values[1:]:
            total += value
        tensor.copy_(total)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        for out, value in zip(tensor_list, self._group(group).exchange(tensor.detach().clone()), strict=True):
            out.copy_(value)

    def all_to_all_single(
        self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
    ):
        group = self._group(group)
        n = len(group.ranks)
        sent = input.detach().clone().split(input_split_sizes or [input.shape[0] // n] * n)
        received = [theirs[group.rank()] for theirs in group.exchange(sent)]
        if output_split_sizes is not None:
            assert [r.shape[0] for r in received] == list(output_split_sizes), "split sizes disagree across ranks"
        output.copy_(torch.cat(received))

    def install(self, monkeypatch):
        names = ("get_world_size", "get_rank", "get_process_group_ranks", "new_group", "all_reduce", "all_gather")
        for name in (*names, "all_to_all_single"):
            monkeypatch.setattr(dist, name, getattr(self, name))
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo")
        checked = comm.check_served

        def record(what, tensors, group):
            self.collectives.append((self.rank(), what, self._group(group).ranks))
            checked(what, tensors, group)

        monkeypatch.setattr(comm, "check_served", record)
        for field in ("training_plan", "dummy_batch"):
            monkeypatch.setattr(STATE, field, getattr(STATE, field))
        monkeypatch.setattr(STATE, "process_groups", ProcessGroups(PerRank(self)))
        return self

    def run(self, fn, *args):
        """``fn(rank, *args)`` on every rank, each in its own thread; returns the results by rank.
        An exception on one rank breaks every group's barrier, so the others stop too."""
        results, errors = [None] * self.size, [None] * self.size

        def worker(rank):
            with self.as_rank(rank):
                try:
                    results[rank] = fn(rank, *args)
                except BaseException as error:  # noqa: B036  (re-raised below, in the caller)
                    errors[rank] = error
                    for group in list(self.groups.values()):
                        group.sync.abort()

        threads = [threading.Thread(target=worker, args=(r,), name=f"rank{r}") for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results

    def issued(self, rank=None):
        """``{name: set of group ranks}`` of the collectives ``rank`` (default all) issued."""
        by_name = {}
        for issuer, what, ranks in self.collectives:
            if rank is None or issuer == rank:
                by_name.setdefault(what, set()).add(ranks)
        return by_name
