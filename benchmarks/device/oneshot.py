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
TAR_RESERVE = 10  # seconds kept for the tarball after the last check


def run_step(name, script, budget, deadline):
    """Run one check; returns its exit status (None: killed at its limit)."""
    limit = min(budget, deadline - time.time())
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
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            emit("FAIL", name, f"killed at its limit of {limit:.0f}s (see logs/{name}.log)")
            return None
    if status != 0:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or [""]
        emit("FAIL", name, f"exit {status} after {time.time() - started:.0f}s: {tail[0][:200]}")
    return status


def cuda_missing():
    """Why this GPU run cannot use CUDA (None when it can)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available(), torch.__version__)"],
        capture_output=True,
        text=True,
    )
    words = probe.stdout.split()
    if probe.returncode == 0 and words and words[0] == "True":
        return None
    return (
        f"torch {words[1] if len(words) > 1 else '?'} sees no CUDA device (env_versions says more); the "
        f"GPU-sized checks are not run on the CPU"
    )


def summarize(figures_lines, out, started):
    records = [json.loads(line) for line in figures_lines if line.strip()]
    counts = {s: sum(r["status"] == s for r in records) for s in ("PASS", "FAIL", "SKIP")}
    emit(
        "DONE",
        "oneshot",
        f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in {time.time() - started:.0f}s",
    )
    (out / "figures.json").write_text(
        json.dumps(
            {
                "dry_run": DRY_RUN,
                "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
                "seconds": round(time.time() - started, 1),
                "counts": counts,
                "records": records,
            },
            indent=1,
            default=str,
        )
    )
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(LOGS, arcname="logs", filter=lambda info: None if info.name.endswith(".pt") else info)
    return counts["FAIL"]


def main():
    out = Path(os.environ["ONESHOT_OUT"])
    started = float(os.environ.get("ONESHOT_STARTED", time.time()))
    deadline = started + float(os.environ.get("ONESHOT_DEADLINE_S", "510")) - TAR_RESERVE
    LOGS.mkdir(parents=True, exist_ok=True)
    figures = WORK / "figures.jsonl"
    os.environ.update(ONESHOT_SUMMARY=str(out / "summary.txt"), ONESHOT_FIGURES=str(figures))
    only = [s for s in os.environ.get("ONESHOT_ONLY", "").split(",") if s]
    no_cuda = None
    for name, script, budget, least in STEPS:
        if only and name not in only:
            continue
        if no_cuda:  # GPU sizes on a CPU would only spend the lease
            emit("SKIP", name, f"(cuda) {no_cuda}")
            continue
        if deadline - time.time() < least:
            emit(
                "SKIP",
                name,
                f"(deadline) {max(deadline - time.time(), 0):.0f}s left of "
                f"{os.environ.get('ONESHOT_DEADLINE_S', '510')}s, it needs at least {least}s",
            )
            continue
        run_step(name, script, budget, deadline)
        if name == "env" and not DRY_RUN:
            no_cuda = cuda_missing()
    failed = summarize(figures.read_text().splitlines() if figures.exists() else [], out, started)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
