"""Running out of device memory in a job whose MoE collectives cross workers stops the job at once,
on every worker, with one line naming the fix; in one process fairseq's recovery (skip the batch)
stays. The most rows one worker's experts received in one MoE call is logged every update.

fairseq's train_step and valid_step catch an out-of-memory error, log it and skip (or retry) the
batch on that worker alone: its peers then wait in the MoE layer's collectives it never joins, until
the timeout (on NCCL the watchdog's, 10 minutes). Emulated on CPU: the experts of one MoE layer
raise CUDA's out-of-memory error on one of two gloo workers, inside a real ``Trainer.train_step``.
"""

import os
import time

import pytest
import torch

from support.launch.dist_utils import run_workers_through_faults
from support.launch.in_process_trainer import build_trainer, collate, sentence_pairs, training_args, write_dictionaries

COMM_TIMEOUT_S = 20  # what today's code makes the other worker wait; the fix must stop well before
OUT_OF_MEMORY = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity)"


def moe_layers(model):
    from fairseq_moe_ext.moe import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def count_expert_rows(model):
    """Rows each MoE layer's experts compute, call by call (appended to the returned list)."""
    seen = []
    for layer in moe_layers(model):

        def counted(x, counts, *args, _forward=layer.experts.forward):
            seen.append(x.shape[0])
            return _forward(x, counts, *args)

        layer.experts.forward = counted
    return seen


def run_out_of_memory_in_the_experts(model):
    layer = moe_layers(model)[0]
    forward = layer.experts.forward

    def out_of_memory(*args):
        layer.experts.forward = forward  # once
        raise torch.OutOfMemoryError(OUT_OF_MEMORY)

    layer.experts.forward = out_of_memory


def logged_step(trainer, task, pairs):
    from fairseq.logging import metrics

    with metrics.aggregate(new_root=True) as logged:
        result = trainer.train_step([collate(task, pairs)])
    return result, logged


def step_then_run_out_of_memory(rank, world, data_dir, out_dir):
    task, trainer = build_trainer(
        training_args(data_dir, world, ["--ddp-backend", "legacy_ddp", "--moe-comm-timeout", str(COMM_TIMEOUT_S)])
    )
    pairs = sentence_pairs(12)[6 * rank : 6 * rank + 6]
    rows = count_expert_rows(trainer.get_model())
    _, logged = logged_step(trainer, task, pairs)
    logged_rows = float(logged["moe_max_rows_received"].avg) if "moe_max_rows_received" in logged else None
    torch.save({"rows": max(rows), "logged": logged_rows}, os.path.join(out_dir, f"first-step-{rank}.pt"))
    if rank == 1:
        run_out_of_memory_in_the_experts(trainer.get_model())
    torch.save(time.monotonic(), os.path.join(out_dir, f"second-step-{rank}.pt"))
    trainer.train_step([collate(task, pairs)])
    return "the step ended without an error"


@pytest.fixture(scope="module")
def two_workers_one_running_out_of_memory(tmp_path_factory):
    root = tmp_path_factory.mktemp("oom")
    data_dir = str(root / "data")
    write_dictionaries(data_dir)
    results = run_workers_through_faults(
        step_then_run_out_of_memory, 2, data_dir, str(root), deadline=3 * COMM_TIMEOUT_S + 60
    )
    load = lambda name: [
        torch.load(root / f"{name}-{r}.pt") if (root / f"{name}-{r}.pt").exists() else None for r in range(2)
    ]
    return results, load("first-step"), load("second-step")


@pytest.mark.slow
def test_out_of_memory_on_one_worker_stops_both_at_once_naming_the_capacity_factor(
    two_workers_one_running_out_of_memory,
):
    results, _, started = two_workers_one_running_out_of_memory
    assert all(r is not None and "error" in r for r in results), results
    for rank, result in enumerate(results):
        message = result["message"]
        assert "worker 1 of 2 ran out of device memory in training" in message, (rank, message)
        assert "--moe-capacity-factor" in message and "--max-tokens" in message and "\n" not in message
        assert result["at"] - started[rank] < COMM_TIMEOUT_S / 2, (rank, result["at"] - started[rank])
    # rank 0: the stop relayed (a MoECommunicationError, and a refusal: one line, naming the worker that stopped)
    assert results[0]["error"] == "MoEPeerStoppedError" and results[1]["error"] == "MoEOutOfMemoryError"


@pytest.mark.slow
def test_every_update_logs_the_most_rows_any_workers_experts_received_in_one_moe_call(
    two_workers_one_running_out_of_memory,
):
    _, first_step, _ = two_workers_one_running_out_of_memory
    assert all(step is not None for step in first_step), first_step
    most = max(step["rows"] for step in first_step)
    assert most > 0 and first_step[0]["rows"] != first_step[1]["rows"], first_step
    assert [step["logged"] for step in first_step] == [most, most]


def test_in_one_process_fairseq_skips_the_batch_that_ran_out_of_memory_and_training_goes_on(tmp_path):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    task, trainer = build_trainer(training_args(data_dir, 1))
    run_out_of_memory_in_the_experts(trainer.get_model())
    skipped, _ = logged_step(trainer, task, sentence_pairs(6))
    rows = count_expert_rows(trainer.get_model())
    trained, logged = logged_step(trainer, task, sentence_pairs(6))
    assert skipped is None and trainer.get_num_updates() == 1  # fairseq's recovery: the batch is skipped
    assert trained is not None and logged["moe_max_rows_received"].avg == max(rows) > 0


def test_out_of_memory_in_validation_stops_the_job_naming_the_eval_capacity_factor(
    tmp_path,
):
    # valid_step would retry the batch on this worker alone (its MoE calls would meet the others'
    # next ones). One process stands in for a worker: its layers are told a group crosses workers.
    from fairseq_moe_ext.fairseq_integration.training import MoEOutOfMemoryError

    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    task, trainer = build_trainer(training_args(data_dir, 1))
    layer = moe_layers(trainer.get_model())[0]
    layer.statistics_group, layer._group_checked = object(), True  # never used: the error comes first

    def out_of_memory(*args):
        raise torch.OutOfMemoryError(OUT_OF_MEMORY)

    layer.router.forward = out_of_memory
    with pytest.raises(MoEOutOfMemoryError) as stopped:
        trainer.valid_step(collate(task, sentence_pairs(6)))
    assert "ran out of device memory in validation" in str(stopped.value)
    assert "--moe-eval-capacity-factor" in str(stopped.value) and "\n" not in str(stopped.value)
