"""Real FSDP shard files, written by fairscale 0.4's ``FullyShardedDataParallel`` on gloo CPU workers, in the
moe/nllb branch's layout: the root (an embedding tied to the output projection, a buffer) wraps two layers
(each FSDP-wrapped, as the branch's ``fsdp_wrap``), and each layer's expert is wrapped over a group of its own
worker (``fsdp_wrap_expert`` with E >= W) or over all workers (``replicas``: the group of an expert's
replicas when E < W). Worker r's ``local_state_dict`` is split as the branch's
``split_shared_and_expert_states`` splits it ("expert" in the name), each half saved with the whole model's
``local_metadata_dict``. fairscale calls ``torch.cuda.synchronize`` unconditionally; it is a no-op here.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

from support.oracles.fairscale_oracle import ORACLE_DIR


class _Layer(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        self.fc = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        torch.manual_seed(100 + rank)  # each worker's expert is its own
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(7, 3), nn.Linear(3, 7))])
        torch.manual_seed(1000)  # and what follows is the same on every worker


class _Model(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 5)
        self.out = nn.Linear(5, 11, bias=False)
        self.out.weight = self.embed.weight
        self.layers = nn.ModuleList([_Layer(rank) for _ in range(2)])
        self.register_buffer("version", torch.tensor([3.0]))


def write_shards(rank: int, world: int, directory: str, replicas: bool):
    """Worker ``rank``'s two files; returns its model's full state before wrapping (the expected result)."""
    sys.path.append(str(ORACLE_DIR))  # a worker process of its own: fairscale stays on its path until it exits
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    torch.cuda.synchronize = lambda *args: None
    solo = [dist.new_group([r]) for r in range(world)]
    model = _Model(rank)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    cpu = {"compute_device": torch.device("cpu")}
    for layer in model.layers:
        group = dist.group.WORLD if replicas else solo[rank]
        layer.experts[0] = FSDP(layer.experts[0], process_group=group, **cpu)
    model.layers = nn.ModuleList([FSDP(layer, **cpu) for layer in model.layers])
    wrapped = FSDP(model, **cpu)
    wrapped._lazy_init()
    state = {k: v.clone() for k, v in wrapped.local_state_dict().items()}
    head = {"shard_metadata": wrapped.local_metadata_dict(), "cfg": None, "args": None}
    shared = {k: v for k, v in state.items() if "expert" not in k}
    torch.save({**head, "model": shared}, f"{directory}/ck-shared-shard{rank}.pt")
    experts = {k: v for k, v in state.items() if "expert" in k}
    torch.save({**head, "model": experts}, f"{directory}/ck-rank-{rank}-shard{rank}.pt")
    return full


def write_both(rank: int, world: int, root: str):
    """Worker ``rank``'s files with experts over itself (``<root>/solo``) and over all workers
    (``<root>/replicas``); returns its full state (the experts are the same in both)."""
    full = write_shards(rank, world, f"{root}/solo", replicas=False)
    write_shards(rank, world, f"{root}/replicas", replicas=True)
    return full
