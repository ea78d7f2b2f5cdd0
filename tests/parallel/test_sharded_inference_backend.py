"""Expert-sharded inference (lock-step generation) starts its process group with the backend the
command line asks for: fairseq's --distributed-backend on GPUs (nccl by default, "cuda:gloo" to
run two workers on one GPU), gloo on CPUs. Checked without a GPU by faking CUDA's presence."""

import argparse

import pytest
import torch
import torch.distributed as dist

from fairseq_moe_ext.fairseq_integration import inference
from fairseq_moe_ext.parallel.process_state import STATE


class Started(Exception):
    """Raised by the fake fairseq loader: the process group was set up, nothing more to see."""


def generate_args(**flags):
    args = dict(
        path="ck/checkpoint_best.pt",
        distributed_world_size=2,
        moe_inference_experts="sharded",
        cpu=False,
        beam=5,
        distributed_backend="nccl",
    )
    return argparse.Namespace(**{**args, **flags})


@pytest.fixture
def two_torchrun_workers_on_one_gpu(monkeypatch):
    """This process as worker 1 of 2 under torchrun, on a machine with one (fake) GPU; records what
    the sharded load would start."""
    started = {}
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: started.setdefault("device", device))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: started.setdefault("backend", backend))
    monkeypatch.setattr(STATE, "inference", None)
    yield started
    STATE.inference = None


def start_sharded_generation(args):
    inference.decide_inference_run(args)
    assert STATE.inference.sharded is not None, "the run should keep its experts sharded"

    def fairseq_load(*_args, **_kwargs):
        raise Started

    with pytest.raises(Started):
        inference.load_sharded(fairseq_load, [args.path])


@pytest.mark.parametrize("backend", ["cuda:gloo", "gloo", "nccl"])
def test_lock_step_generation_on_a_gpu_uses_the_distributed_backend_the_command_line_names(
    two_torchrun_workers_on_one_gpu, backend
):
    start_sharded_generation(generate_args(distributed_backend=backend))
    # Worker 1 of 2 on the one GPU there is: device 0 (set_device(1) would fail there).
    assert two_torchrun_workers_on_one_gpu == {"backend": backend, "device": 0}


def test_lock_step_generation_on_cpus_uses_gloo_and_no_gpu_whatever_the_backend_flag_says(
    two_torchrun_workers_on_one_gpu,
):
    start_sharded_generation(generate_args(cpu=True, distributed_backend="nccl"))
    assert two_torchrun_workers_on_one_gpu == {"backend": "gloo"}
