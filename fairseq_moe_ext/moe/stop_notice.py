"""Why a worker stopped, told to the others through the process group's store.

A worker that stops on purpose in the middle of a step (out of memory, below) leaves the others
waiting in an MoE collective; on gloo they fail as soon as its connection closes, with a transport
error that says nothing of the reason. Before it stops, the worker writes its one-line error into
the key-value store every worker already shares (torch.distributed's rendezvous store), and the
others' failing collective reads it back (``comm.collective``): every worker ends with the same
line. Best effort: without a store (rank 0, which hosts it, is the one that stopped), the others
keep the transport error. On NCCL the others are not woken by a closed connection: they stop when
the launcher ends the job or the watchdog's timeout runs out.
"""

from typing import Optional

from .torch_compat import default_store

KEY = "fairseq_moe_ext/stop_notice"


def _store():
    return default_store()  # torch has no public accessor: see torch_compat


def announce_stop(message: str) -> None:
    store = _store()
    if store is not None:
        try:
            store.set(KEY, message)
        except Exception:  # noqa: BLE001  (the worker stops with its own error either way)
            pass


def announced_stop() -> Optional[str]:
    """The line a worker announced before it stopped, if any (never waits for one)."""
    store = _store()
    if store is None:
        return None
    try:
        return store.get(KEY).decode() if store.check([KEY]) else None
    except Exception:  # noqa: BLE001  (the store went with the worker that hosted it)
        return None
