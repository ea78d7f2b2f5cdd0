"""Shared experts (``--moe-shared-expert-count``) are shared parameters under every backend, also where
the routed experts are sharded over their replica group (``--ddp-backend fully_sharded
--moe-fully-sharded-experts sharded``).

They run as a ``BatchedExperts`` of one wide expert, the routed experts' module type, but carry no
``expert`` marker: every worker holds them and their gradient is averaged over the world. Taken for
routed experts, they were an FSDP2 unit over the replica group whose gradient was summed there and
never divided by W (update 1's gradient norm on 2 workers, P = 1: 4.923 against 4.458 for one process
and legacy_ddp). On W = 2 with P = 1 each gloo worker takes one NAG step of two micro-batches through
fairseq's Trainer; one process holding everything takes it on the whole batch.
"""

import pytest

from support.launch.dist_utils import run_on_workers
from support.launch.in_process_trainer import (
    assert_step_equals_one_process,
    build_trainer,
    micro_batches,
    one_step,
    replicated_case_flags,
    training_args,
    write_dictionaries,
)
from support.launch.mixed_precision_steps import NAG

pytestmark = pytest.mark.slow

WORLD, EXPERTS, PARALLEL, SHARES = 2, 4, 1, [5, 7]
SHARED_EXPERTS = ["--moe-shared-expert-count", "1"]
SHARDED = ["--ddp-backend", "fully_sharded", "--moe-fully-sharded-experts", "sharded"]
MICRO_BATCHES = 2


def shared_expert_names(model):
    return [n for n, _ in model.named_parameters() if ".shared_experts." in n]


def shared_experts_worker(rank, world, data_dir):
    from fairseq_moe_ext.parallel import fully_sharded

    flags = replicated_case_flags(EXPERTS, PARALLEL, [*NAG, *SHARED_EXPERTS])
    task, trainer = build_trainer(training_args(data_dir, world, [*SHARDED, *flags]))
    model = trainer.get_model()
    start = sum(SHARES[:rank])
    batches = [b[start : start + SHARES[rank]] for b in micro_batches(SHARES, MICRO_BATCHES)]
    result = one_step(task, trainer, *batches)
    params = dict(model.named_parameters())
    names = shared_expert_names(model)
    # Over which workers each shared expert tensor is sharded: the world, as every shared parameter.
    result["meshes"] = {n: params[n].device_mesh.size() if fully_sharded.is_sharded(params[n]) else 0 for n in names}
    result["marked"] = [n for n in names if getattr(params[n], "expert", False)]
    result["held"] = fully_sharded.held_bytes(model, trainer.optimizer.optimizer)
    trainer.consolidate_optimizer()
    saved = trainer.state_dict()["model"]
    result["saved"] = {n: saved.get(n) is not None for n in names}
    result["params"] = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in result["params"].items()}
    return result


def test_shared_experts_under_sharded_experts_step_like_one_process_sharded_over_world(tmp_path):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    results = run_on_workers(shared_experts_worker, WORLD, data_dir)
    names = list(results[0]["meshes"])
    assert names, "the model should have shared experts"
    flags = replicated_case_flags(EXPERTS, PARALLEL, [*NAG, *SHARED_EXPERTS])
    assert_step_equals_one_process(results, data_dir, SHARES, flags, MICRO_BATCHES, PARALLEL)
    for rank, r in enumerate(results):
        assert r["marked"] == [], f"rank {rank}: shared experts carry the expert marker: {r['marked']}"
        assert set(r["meshes"].values()) == {WORLD}, f"rank {rank}: not sharded over the world: {r['meshes']}"
        # A save gathers them on rank 0 alone (the shared state is stored once).
        assert all(r["saved"].values()) == (rank == 0) and any(r["saved"].values()) == (rank == 0), r["saved"]
    whole = sum(results[0]["params"][n].numel() * 4 for n in names)
    assert whole and all(r["held"]["shared_params"] > 0 for r in results)
