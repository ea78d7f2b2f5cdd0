"""Timing and memory measurement shared by the benchmarks.

Contenders are timed side by side: each repetition runs every contender once, in turn, so a slow
spell of the machine (other processes, thermal state) hits all of them alike; medians over
repetitions then drop the outliers. Peak memory on CPU is measured in a fresh subprocess per
contender (the growth of the peak resident set over one step), because torch's CPU allocator keeps no
statistics and a process's peak RSS never goes down.
"""

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List

import torch


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_interleaved(steps: Dict[str, Callable[[], None]], reps: int, warmup: int, device) -> Dict[str, List[float]]:
    """Seconds per call of each step, ``reps`` rounds after ``warmup`` rounds, interleaved."""
    times = {name: [] for name in steps}
    for rnd in range(warmup + reps):
        for name, step in steps.items():
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            if rnd >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def median(values: List[float]) -> float:
    return statistics.median(values)


def spread(values: List[float]) -> float:
    """Relative half-range of the middle of the samples, a rough noise figure."""
    if len(values) < 3:
        return float("nan")
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / 2 / statistics.median(values)


def load_average() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_summary(device) -> str:
    lines = [
        f"torch {torch.__version__}, python {platform.python_version()}, {torch.get_num_threads()} threads, "
        f"cpu: {cpu_model()} ({os.cpu_count()} logical cpus), load average {load_average()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}",
    ]
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        lines.append(f"gpu: {props.name}, capability {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB")
    return "\n".join(lines)


def max_rss_bytes() -> int:
    """This process's peak resident set. VmHWM, not ru_maxrss: Linux carries ru_maxrss over from
    the parent across fork and exec, so a child of a big benchmark process would never see its
    own peak rise."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def peak_step_memory(step: Callable[[], None], device) -> int:
    """Bytes by which one step raises the peak (GPU: allocated; CPU: resident) over what existed
    before it. On CPU, call it in a fresh process, once."""
    if torch.device(device).type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    before = max_rss_bytes()
    step()
    return max_rss_bytes() - before


def memory_in_subprocess(script: str, args: List[str], timeout: float = 600) -> Dict:
    """Run ``script args --memory-probe`` in a fresh interpreter; it prints one JSON line last."""
    done = subprocess.run(
        [sys.executable, script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not last.startswith("{"):
        return {"error": f"exit {done.returncode}: {last[-300:]}"}
    return json.loads(last)
