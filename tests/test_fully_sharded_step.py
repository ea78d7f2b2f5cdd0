"""``--ddp-backend fully_sharded`` (torch FSDP2) through fairseq's own Trainer equals one process.

Each gloo worker runs one real ``Trainer.train_step`` with the shared part sharded over the world
and the experts expert-parallel; one process holding everything runs the same step on the whole
batch (``assert_step_equals_one_process``: loss, gate loss, clipped gradient norm, every updated
parameter, experts by global id, replicas identical). SGD without momentum catches a wrong gradient
scale; NAG checks the optimizer's sliced state. The same workers count the bytes each holds.
"""

import pytest
import torch

from dist_utils import run_on_workers
from test_fairseq_expert_parallel import (
    assert_step_equals_one_process, expert_parallel_worker, replicated_case_flags, write_dictionaries,
)

pytestmark = pytest.mark.slow

# fairseq's NAG keeps a momentum buffer per parameter (Adam's flags clash with the oracle's --momentum).
NAG = ["--optimizer", "nag", "--momentum", "0.9", "--lr", "0.1"]

# (experts, P or None for the default, token shares per worker, extra flags); every case on W workers.
CASES = {
    2: [
        (4, None, [5, 7], []),  # P = W = 2
        (4, 1, [6, 6], NAG),  # P = 1 < W
    ],
    4: [
        (4, None, [2, 5, 3, 4], ["--moe-capacity-factor", "0.5", "--moe-batch-prioritized-routing"]),  # P = W
        (2, None, [3, 3, 4, 2], NAG),  # P = 2
    ],
}


def whole(result):
    """The worker's parameters as whole tensors (the shared ones are FSDP2 slices until gathered)."""
    result["params"] = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in result["params"].items()}
    return result


def fully_sharded_cases_worker(rank, world, data_dir):
    from fairseq_moe_ext import fully_sharded

    results = []
    for experts, parallel, shares, extra in CASES[world]:
        flags = replicated_case_flags(experts, parallel, extra)
        result = expert_parallel_worker(rank, world, data_dir, shares, "fully_sharded", flags, 1)
        results.append(whole(result))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_one_fully_sharded_trainer_step_equals_one_process_holding_everything(tmp_path, world):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    by_rank = run_on_workers(fully_sharded_cases_worker, world, data_dir)
    for i, (experts, parallel, shares, extra) in enumerate(CASES[world]):
        results = [r[i] for r in by_rank]
        parallel_size = parallel or min(world, experts)
        assert results[0]["params"][results[0]["expert_names"][0]].shape[0] == experts // parallel_size
        assert_step_equals_one_process(results, data_dir, shares, replicated_case_flags(experts, parallel, extra),
                                       1, parallel_size)
