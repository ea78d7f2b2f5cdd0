"""The GPU checks are ready for the first GPU: they parse, and without CUDA they say so and exit 2
(the code the device tool and CI read as "not run here") instead of failing half-way."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = {"CUDA_VISIBLE_DEVICES": ""}


def run(*command):
    env = dict(__import__("os").environ, **NO_CUDA, PYTHON=sys.executable)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the scripts would run for real")
@pytest.mark.parametrize("command", [
    ("bash", "benchmarks/gpu_smoke.sh"),
    (sys.executable, "benchmarks/grouped_mm_check.py"),
    ("bash", "benchmarks/gpu_check.sh"),
], ids=["gpu_smoke", "grouped_mm_check", "gpu_check"])
def test_a_gpu_check_without_cuda_exits_2_with_one_line_saying_it_needs_a_gpu(command):
    result = run(*command)
    assert result.returncode == 2, result.stdout + result.stderr
    said = (result.stderr or result.stdout).strip().splitlines()
    assert said and ("CUDA" in said[-1] or "GPU" in said[-1]), said


def test_the_gpu_smoke_script_parses_and_lists_its_knobs():
    assert run("bash", "-n", "benchmarks/gpu_smoke.sh").returncode == 0
    usage = run("bash", "benchmarks/gpu_smoke.sh", "--help")
    assert usage.returncode == 0 and all(knob in usage.stdout for knob in ("GPUS", "DRY_RUN", "WORK"))
