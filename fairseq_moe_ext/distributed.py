"""Which workers share experts, and the expert-aware side of data-parallel training."""

import torch.distributed as dist

_GROUP_CACHE = {}


def expert_parallel_group():
    """The process group experts are spread over: every worker of the job, or ``None`` in a single
    process (then every expert is local).

    A dedicated group (same members as the default one) keeps the MoE all-to-alls in their own
    queue, separate from the gradient all-reduces that data-parallel wrappers issue asynchronously.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    key = id(dist.group.WORLD)  # a new default group (re-initialised job) needs a new MoE group
    if key not in _GROUP_CACHE:
        _GROUP_CACHE.clear()
        _GROUP_CACHE[key] = dist.new_group(list(range(dist.get_world_size())))
    return _GROUP_CACHE[key]
