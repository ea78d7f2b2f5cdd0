"""Experts on other workers: how many rows go where, from the layer's exchange, and the all-to-all there and back.

With an expert-parallel ``group`` of P workers each holds ``L = E / P`` experts. Every worker's slots per
expert came with the layer's one exchange (``batch_totals.py``, ``sent`` ``[W, E]`` after any capacity), so
the rows each peer sends to this worker's experts are known without a count exchange of their own; the
host reads them, with this worker's own, once (the all-to-all's split sizes and the expert GEMMs' row counts
must be host integers), or not at all where a lock-step round read every worker's counts already.
"""

from typing import Callable, List, Optional, Tuple

import torch

from . import comm
from .dispatch import inverse_permutation, permute_rows


def rows_per_expert(
    expert_load: torch.Tensor, sent: torch.Tensor, host_counts, group, statistics_group, peers, local: int
) -> Tuple[List[int], Optional[Tuple[torch.Tensor, List[int]]]]:
    """``(rows per global expert sent from here, (the rows each peer sends to this worker's experts, [P, L] on
    the device, and flat on the host) or None with no expert parallelism)``. ``expert_load`` ``[E]``: this
    worker's; ``sent``: every worker's (rows of the statistics group; ``peers``: where the expert-parallel group's
    members are among them, ``comm.ranks_within``); ``host_counts``: every worker's slots per choice and expert
    already on the host (``[W][k * E]``, with no capacity), or None."""
    if group is None:
        return expert_load.tolist(), None
    num_experts = expert_load.shape[0]
    mine = comm.group_rank(group) * local
    recv_counts = comm.rows_of_group(sent, peers)[:, mine : mine + local]
    if host_counts is not None:
        sent_host = [[int(sum(w[e::num_experts])) for e in range(num_experts)] for w in host_counts]
        from_peers = sent_host[peers] if isinstance(peers, slice) else [sent_host[p] for p in peers]
        recv_flat = [n for peer in from_peers for n in peer[mine : mine + local]]
        return sent_host[comm.group_rank(statistics_group)], (recv_counts, recv_flat)
    both = torch.cat([expert_load, recv_counts.to(expert_load.device).reshape(-1)]).tolist()
    return both[:num_experts], (recv_counts, both[num_experts:])


def through_their_workers(dispatched, loads: List[int], exchange, experts: Callable, group, local: int):
    """``experts(rows, rows per local expert (host), the same on the device)`` applied to ``dispatched`` (rows
    in global expert order, ``loads`` of them per expert) on the workers holding those experts: one
    all-to-all there, one back."""
    parallel = comm.group_size(group)
    recv_counts, recv_flat = exchange  # [source rank, local expert], on the device and the host
    send_splits = [sum(loads[r * local : (r + 1) * local]) for r in range(parallel)]
    recv_splits = [sum(recv_flat[r * local : (r + 1) * local]) for r in range(parallel)]
    received = comm.all_to_all(dispatched, send_splits, recv_splits, group)
    # Rows arrive grouped by source rank; experts want them grouped by local expert.
    row_expert = torch.repeat_interleave(
        torch.arange(local, device=received.device).repeat(parallel),
        recv_counts.reshape(-1).to(received.device),
        output_size=received.shape[0],
    )
    by_expert = torch.argsort(row_expert, stable=True)
    from_expert = inverse_permutation(by_expert)
    local_counts = [sum(recv_flat[i::local]) for i in range(local)]
    out = experts(permute_rows(received, by_expert, from_expert), local_counts, recv_counts.sum(0))
    out = permute_rows(out, from_expert, by_expert)
    return comm.all_to_all(out, recv_splits, send_splits, group)
