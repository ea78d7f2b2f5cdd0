"""What a save writes into each worker's file: ``state["moe"]``, saying which model keys and which
optimizer slots belong to experts, and for rank r > 0 nothing but its experts."""

from typing import Dict, List, Optional

from .contents import experts_held


def moe_metadata(
    optimizer_param_names: List[str],
    expert_param_names: List[str],
    world_size: int,
    rank: int,
    num_updates: int,
    set_id: Optional[str] = None,
    experts_per_worker: Optional[int] = None,
) -> Dict:
    """``expert_param_names`` double as model state keys (fairseq saves ``model.state_dict()``);
    ``set_id`` and ``experts_per_worker`` make the file self-describing (see contents.py)."""
    expert = set(expert_param_names)
    described = {} if set_id is None else {"set_id": set_id}
    if experts_per_worker is not None:
        described["experts_held"] = experts_held(rank, experts_per_worker)
    return {
        **described,
        "world_size": world_size,
        "rank": rank,
        "num_updates": num_updates,
        "expert_keys": list(expert_param_names),
        "optimizer_param_names": list(optimizer_param_names),
        "optimizer_expert_slots": [i for i, n in enumerate(optimizer_param_names) if n in expert],
    }


def strip_shared_state(state: Dict) -> Dict:
    """Keep only what rank r > 0 must store: its experts and their optimizer state."""
    meta = state["moe"]
    expert_keys = set(meta["expert_keys"])
    state["model"] = {k: v for k, v in state["model"].items() if k in expert_keys}
    optimizer = state.get("last_optimizer_state")
    if isinstance(optimizer, dict) and "state" in optimizer:
        slots = set(meta["optimizer_expert_slots"])
        optimizer["state"] = {i: s for i, s in optimizer["state"].items() if i in slots}
    return state
