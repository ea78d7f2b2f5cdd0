"""Waits that NCCL's watchdog ends (an abort of the job after the group's timeout, not an exception):
how long an MoE collective waits by default, and where workers wait for rank 0's file work.

While rank 0 hashes a checkpoint set (resume) or writes and hashes its files (save), the other
workers wait for it on a group whose timeout is hours, not on fairseq's default group, which on
GPUs is NCCL with a 10-minute watchdog. Emulated on gloo workers whose default group times out
after 2 seconds, with rank 0's hashing made slower than that."""

import argparse
import time

import pytest

from fairseq_moe_ext import checkpoint as moe_ckpt
from support.inputs.fake_checkpoints import full_state
from support.launch.dist_utils import run_workers_through_faults

DEFAULT_GROUP_TIMEOUT_S = 2.0  # stands for fairseq's NCCL timeout
SLOW_HASH_S = 2.5 * DEFAULT_GROUP_TIMEOUT_S


TORCH_NCCL_DEFAULT_TIMEOUT_S = 600  # kProcessGroupNCCLDefaultTimeout, what fairseq's default group gets on GPUs


def test_an_moe_collective_waits_for_a_peer_no_longer_than_fairseqs_own_by_default(monkeypatch):
    # On NCCL a dead peer is seen only when this runs out: every GPU of the job idles until then.
    from fairseq_moe_ext.parallel.plan import ParallelPlan

    plan = ParallelPlan.for_model(argparse.Namespace(), ("decoder",))  # a model built with the default flags
    assert 0 < plan.comm_timeout_s <= TORCH_NCCL_DEFAULT_TIMEOUT_S


def resume_and_save_while_rank_0_hashes_slowly(rank, world, set_dir):
    import types

    from fairseq_moe_ext import checkpoint as moe_ckpt
    from fairseq_moe_ext.checkpoint import manifest
    from fairseq_moe_ext.fairseq_integration.loading import decided_on_rank_0
    from fairseq_moe_ext.fairseq_integration.saving import torch_collectives

    hashing = manifest.file_digest

    def slow_digest(path):
        time.sleep(SLOW_HASH_S)  # a large set on a slow filesystem
        return hashing(path)

    if rank == 0:
        manifest.file_digest = slow_digest
    resolved = decided_on_rank_0(lambda: moe_ckpt.resolve(f"{set_dir}/checkpoint_last.pt"))
    # The save's collectives: rank 0 is the last to finish its file (here: its hashing) each time.
    comm = torch_collectives(types.SimpleNamespace(data_parallel_rank=rank, data_parallel_world_size=world))
    protected = comm.broadcast([slow_digest(__file__)] if rank == 0 else None)
    reports = comm.all_gather(slow_digest(__file__) if rank == 0 else rank)
    comm.barrier()
    return resolved.kind, resolved.path, len(protected), len(reports)


@pytest.mark.slow
def test_other_workers_wait_for_rank_0_hashing_a_set_longer_than_the_default_groups_timeout(tmp_path):
    (tmp_path / "set").mkdir()
    moe_ckpt_path = str(tmp_path / "set" / "checkpoint_last")
    moe_ckpt.save_set(full_state(), moe_ckpt_path, 2)
    results = run_workers_through_faults(
        resume_and_save_while_rank_0_hashes_slowly,
        2,
        str(tmp_path / "set"),
        deadline=150,
        timeout_s=DEFAULT_GROUP_TIMEOUT_S,
    )
    assert all(result is not None and "returned" in result for result in results), results
    for result in results:
        assert result["returned"] == ("set", moe_ckpt_path + ".set.json", 1, 2)
