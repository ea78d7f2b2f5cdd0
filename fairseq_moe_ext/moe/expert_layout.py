"""Where the experts of a W-worker job live: the arithmetic of the expert-parallel layout.

No process group here (``parallel/plan.py`` creates the groups from this layout; checkpoint code places
experts by it), so it can be reasoned about and tested without any worker. The P arithmetic lives here
once: the valid P's of a job (``valid_parallel_sizes``), whether a P fits it (``divides_layout``) and the
line refusing one that does not (``parallel_size_refusal``), used by the models, the checkpoint tool,
prune and ``plan``.
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..common.refusal import MoEOptionError


@dataclass(frozen=True)
class ExpertLayout:
    """Where the experts of a W-worker job live, with expert-parallel size P.

    The world splits into W/P expert-parallel groups of P consecutive ranks ``{g*P, ..., g*P+P-1}``.
    Within one, the worker of ``ep_rank = rank % P`` holds experts ``ep_rank*E/P .. (ep_rank+1)*E/P - 1``
    and tokens travel to them by all-to-all. Workers with the same ``ep_rank`` in different groups
    hold replicas of the same experts: the replica group ``{ep_rank + j*P}``. 4 workers, 2 experts
    (P = 2)::

                          replica group {0, 2}   replica group {1, 3}
        EP group {0, 1}:  rank 0: expert 0       rank 1: expert 1
        EP group {2, 3}:  rank 2: expert 0       rank 3: expert 1

    All-to-all of tokens and the expert part of the gradient norm: within an EP group (a row).
    Expert gradients: summed over a replica group (a column). Routing statistics (balance loss,
    z-loss, capacity) and shared gradients: the whole world. One process: ``ExpertLayout(1, 1, 0)``.
    """

    world_size: int
    parallel_size: int
    rank: int

    def __post_init__(self):
        w, p, r = self.world_size, self.parallel_size, self.rank
        if not all(isinstance(v, int) for v in (w, p, r)) or w < 1 or p < 1 or w % p or not 0 <= r < w:
            raise MoEOptionError(
                f"no expert layout has world size {w!r}, expert-parallel size {p!r} and rank {r!r}: the "
                f"expert-parallel size must divide the world size, and 0 <= rank < world size"
            )

    @property
    def ep_rank(self) -> int:
        """This worker's place in its expert-parallel group (which experts it holds)."""
        return self.rank % self.parallel_size

    @property
    def replica_index(self) -> int:
        """Which expert-parallel group this worker is in (which replica of its experts it holds)."""
        return self.rank // self.parallel_size

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.parallel_size

    @property
    def parallel_group_ranks(self) -> Tuple[int, ...]:
        first = self.replica_index * self.parallel_size
        return tuple(range(first, first + self.parallel_size))

    @property
    def replica_group_ranks(self) -> Tuple[int, ...]:
        return tuple(range(self.ep_rank, self.world_size, self.parallel_size))

    def all_parallel_groups(self) -> List[Tuple[int, ...]]:
        """Every expert-parallel group of the job, in replica order (the same list on every rank)."""
        p = self.parallel_size
        return [tuple(range(g * p, (g + 1) * p)) for g in range(self.num_replicas)]

    def all_replica_groups(self) -> List[Tuple[int, ...]]:
        """Every replica group of the job, in ``ep_rank`` order (the same list on every rank)."""
        return [tuple(range(e, self.world_size, self.parallel_size)) for e in range(self.parallel_size)]

    def experts_held(self, num_experts: int) -> range:
        """Global ids of the experts this worker holds, of ``num_experts`` (a multiple of P)."""
        if num_experts % self.parallel_size:
            raise MoEOptionError(
                f"{num_experts} experts cannot be split over an expert-parallel size of {self.parallel_size}: "
                f"use an expert count that is a multiple of it"
            )
        local = num_experts // self.parallel_size
        return range(self.ep_rank * local, (self.ep_rank + 1) * local)


def default_expert_parallel_size(world_size: int, *num_experts: int) -> int:
    """The largest P dividing both W and E (every E given: each side's, where the encoder and decoder hold
    different numbers of experts): P = W (each worker one shard, no replicas) whenever E is a multiple of
    W, which is the only layout there was before P could be chosen."""
    return math.gcd(world_size, *num_experts)


def valid_parallel_sizes(world_size: int, *num_experts: int) -> List[int]:
    """Every P a layout of ``world_size`` workers and these expert counts allows (P divides W and every E):
    the divisors of the default P, smallest first. The one list the models, the checkpoint tool, prune and
    ``plan`` offer."""
    largest = default_expert_parallel_size(world_size, *num_experts)
    return [p for p in range(1, largest + 1) if largest % p == 0]


def divides_layout(parallel_size: int, world_size: int, *num_experts: int) -> bool:
    """Does P divide the W workers (into W/P replica groups) and every E (E/P experts per worker)?"""
    return parallel_size >= 1 and world_size % parallel_size == 0 and all(e % parallel_size == 0 for e in num_experts)


def listed(choices: List[int]) -> str:
    """``[1, 2, 4]`` as a message lists it: ``1, 2 or 4``."""
    words = [str(c) for c in choices]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def parallel_size_refusal(
    size: int, world_size: int, experts: Dict[str, int], flag: str = "--moe-expert-parallel-size"
) -> Optional[str]:
    """The one line refusing ``flag size`` for ``world_size`` workers and ``experts`` ({the flag and value that
    set a count: the count}, one per side), or None when P divides both."""
    if divides_layout(size, world_size, *experts.values()):
        return None
    named = " and ".join(dict.fromkeys(experts))
    choices = listed(valid_parallel_sizes(world_size, *experts.values()))
    fix = f"use a P dividing both {world_size} and {named} ({choices})"
    if size < 1 or world_size % size:
        return f"{flag} {size} does not divide the {world_size} workers: {fix}"
    wrong = next(name for name, count in experts.items() if count % size)
    return f"{flag} {size} does not divide {wrong}: {fix}"
