"""A capacity in batch order decided from each worker's counts alone keeps exactly the slots that the
decision over the gathered batch keeps (``slots_within_capacity`` on the workers' rows laid end to end),
and counts every worker's served slots as that decision does: no routing decision has to travel."""

import pytest
import torch

from fairseq_moe_ext.moe.capacity import slots_within_capacity, slots_within_capacity_of_counts

E = 5


def worker_choices(sizes, k, seed):
    """Each worker's ``[N_r, k]`` distinct choices, some tokens padding (id E) and some second choices unrouted."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for n in sizes:
        index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)]) if n else torch.empty(0, k)
        index = index.long()
        pads = torch.rand(n, generator=g) < 0.2
        index[pads] = E
        if k > 1:
            index[torch.rand(n, generator=g) < 0.2, 1] = E  # the "random" second-expert policy's dropped seconds
        batches.append(index)
    return batches


def counts_of(index, k):
    return torch.stack([torch.stack([(index[:, j] == e).sum() for e in range(E)]) for j in range(k)])


@pytest.mark.parametrize("sizes", [[9], [6, 0, 11], [7, 3], [1, 1, 1, 1]])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("capacity", [0, 1, 3, 7, 100])
def test_each_workers_kept_slots_and_everyones_served_counts_equal_the_gathered_decision(sizes, k, capacity):
    batches = worker_choices(sizes, k, seed=len(sizes) * 10 + k)
    counts = torch.stack([counts_of(b, k) for b in batches])  # [W, k, E], what the exchange carries
    everyone = torch.cat(batches)
    want = slots_within_capacity(everyone, E, torch.tensor(capacity))
    start = 0
    for rank, index in enumerate(batches):
        keep, kept = slots_within_capacity_of_counts(index, E, torch.tensor(capacity), counts, rank)
        assert torch.equal(keep[index < E], want[start : start + len(index)][index < E]), f"worker {rank}"
        start += len(index)
        served = torch.where(want, everyone, E)
        ends = torch.tensor(sizes).cumsum(0).tolist()
        want_kept = [[(served[a:b] == e).sum().item() for e in range(E)] for a, b in zip([0] + ends, ends)]
        assert kept.tolist() == want_kept
