#!/usr/bin/env python
"""The one-shot's checks in order of value, each a process of its own with its share of the
deadline; run by benchmarks/gpu_oneshot.sh (read that first). Writes to OUT: summary.txt (one line
per result, appended as they come), figures.json (every result with its figures) and logs.tar.gz
(WORK/logs, no .pt files). Exit 1 when any line is FAIL.
"""

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from report import DRY_RUN, HERE, LOGS, WORK, emit

# (name, script, the most seconds it may take, the least it needs to start). The first imports the
# plugin and builds a model under this torch before anything else runs.
# fmt: off
STEPS = [
    ("env", "oneshot_env.py", 90, 10),
    ("layer", "oneshot_layer.py", 100, 20),
    ("grouped", "oneshot_grouped.py", 80, 15),
    ("groups", "oneshot_groups.py", 90, 20),
    ("bench", "oneshot_bench.py", 80, 20),
    ("fairseq", "oneshot_fairseq.py", 330, 40),
]
# fmt: on
# Seconds no earlier check may take from a later one: the fairseq step (single-GPU runs, the two-rank
# cuda:gloo runs and generation, side by side) came last and was the likeliest to be cut.
RESERVED = {"fairseq": 200}
TAR_RESERVE = 10  # seconds kept for the tarball after the last check
PROBE_TIMEOUT = 60  # seconds for the CUDA probe after env (a wedged driver must not spend the lease)
# The CPU dry run shares its machine (a test suite's other worker, other jobs): its limits are the GPU
# run's times ONESHOT_TIME_SCALE, so that a loaded machine stretches them instead of a slow check being
# called a hang. A hang still meets the stretched limit. The GPU run ignores it: its lease is fixed.
TIME_SCALE = float(os.environ.get("ONESHOT_TIME_SCALE") or 1) if DRY_RUN else 1.0


def run_step(name, script, budget, deadline):
    """Run one check; returns its exit status (None: killed at its limit). The check's process group is
    killed in a ``finally``, whatever ends this one (its limit, a SIGTERM from the machine's own limit)."""
    limit = min(budget * TIME_SCALE, deadline - time.time())
    log = LOGS / f"{name}.log"
    env = dict(os.environ, ONESHOT_DEADLINE=str(time.time() + limit), PYTHONUNBUFFERED="1")
    started = time.time()
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, str(HERE / script)], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            status = process.wait(timeout=limit + 5)  # the check watches its own deadline; this is the backstop
        except subprocess.TimeoutExpired:
            emit("FAIL", name, f"killed at its limit of {limit:.0f}s (see logs/{name}.log)")
            return None
        finally:
            stop_group(process)
    if status != 0:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or [""]
        emit("FAIL", name, f"exit {status} after {time.time() - started:.0f}s: {tail[0][:200]}")
    return status


def stop_group(process, grace=10):
    """SIGTERM to the check's process group (the fairseq check kills the runs it started, each in a
    session of its own, in its ``finally``), SIGKILL after ``grace`` seconds; then what is left of it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            if sig == signal.SIGTERM:
                grace = 1  # the check is gone: SIGKILL what it left in its group
        except subprocess.TimeoutExpired:
            pass


def cuda_missing():
    """Why this GPU run cannot use CUDA (None when it can)."""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.is_available(), torch.__version__)"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return f"the CUDA probe (torch.cuda.is_available()) did not answer in {PROBE_TIMEOUT}s; the GPU-sized checks are not run"
    words = probe.stdout.split()
    if probe.returncode == 0 and words and words[0] == "True":
        return None
    return (
        f"torch {words[1] if len(words) > 1 else '?'} sees no CUDA device (env_versions says more); the "
        f"GPU-sized checks are not run on the CPU"
    )


def write_outputs(figures_lines, out, started, final=False):
    """figures.json and logs.tar.gz as they stand: rewritten after every check, so that a run cut off by
    the machine's own limit still brings back everything up to its last finished check."""
    records = [json.loads(line) for line in figures_lines if line.strip()]
    counts = {s: sum(r["status"] == s for r in records) for s in ("PASS", "FAIL", "SKIP")}
    if final:
        emit(
            "DONE",
            "oneshot",
            f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in {time.time() - started:.0f}s",
        )
    document = {
        "dry_run": DRY_RUN,
        "card": os.environ.get("ONESHOT_CARD", "?"),
        "finished": final,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "counts": counts,
        "records": records,
    }
    partial = out / "figures.json.partial"  # replaced whole: a reader never sees half a file
    partial.write_text(json.dumps(document, indent=1, default=str))
    os.replace(partial, out / "figures.json")
    with tarfile.open(out / "logs.tar.gz.partial", "w:gz") as tar:
        tar.add(LOGS, arcname="logs", filter=lambda info: None if info.name.endswith(".pt") else info)
    os.replace(out / "logs.tar.gz.partial", out / "logs.tar.gz")
    return counts["FAIL"]


def _stop(signum, frame):
    raise SystemExit(128 + signum)  # the running check is killed in run_step's finally


def main():
    out = Path(os.environ["ONESHOT_OUT"])
    started = float(os.environ.get("ONESHOT_STARTED", time.time()))
    deadline = started + float(os.environ.get("ONESHOT_DEADLINE_S", "510")) * TIME_SCALE - TAR_RESERVE
    LOGS.mkdir(parents=True, exist_ok=True)
    figures = WORK / "figures.jsonl"
    os.environ.update(ONESHOT_SUMMARY=str(out / "summary.txt"), ONESHOT_FIGURES=str(figures))
    signal.signal(signal.SIGTERM, _stop)
    lines = lambda: figures.read_text().splitlines() if figures.exists() else []
    only = [s for s in os.environ.get("ONESHOT_ONLY", "").split(",") if s]
    no_cuda = None
    try:
        for index, (name, script, budget, least) in enumerate(STEPS):
            if only and name not in only:
                continue
            if no_cuda:  # GPU sizes on a CPU would only spend the lease
                emit("SKIP", name, f"(cuda) {no_cuda}")
                continue
            # The checks after this one keep their reserve: this one ends that much before the deadline.
            later = [n for n, *_ in STEPS[index + 1 :] if not only or n in only]
            step_deadline = deadline - sum(RESERVED.get(n, 0) for n in later) * TIME_SCALE
            if step_deadline - time.time() < least * TIME_SCALE:
                emit(
                    "SKIP",
                    name,
                    f"(deadline) {max(step_deadline - time.time(), 0):.0f}s left of "
                    f"{float(os.environ.get('ONESHOT_DEADLINE_S', '510')) * TIME_SCALE:.0f}s"
                    f"{' (the rest reserved for ' + ', '.join(later) + ')' if step_deadline < deadline else ''}, "
                    f"it needs at least {least * TIME_SCALE:.0f}s",
                )
                continue
            run_step(name, script, budget, step_deadline)
            if name == "env" and not DRY_RUN:
                no_cuda = cuda_missing()
            write_outputs(lines(), out, started)
    finally:
        failed = write_outputs(lines(), out, started, final=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
