"""What every one-shot check shares: its summary lines, its figures, its deadline and its sizes.

benchmarks/device/oneshot.py starts each check as a process with these variables set:
ONESHOT_SUMMARY (the summary file, one line appended per result), ONESHOT_FIGURES (JSON lines),
ONESHOT_DEADLINE (epoch seconds the check must finish by), ONESHOT_WORK (scratch: data, runs;
logs under WORK/logs travel back in the tarball, without .pt files) and ONESHOT_DRY_RUN (1: the CPU
dry run, tiny sizes, CUDA-only parts report ``SKIP (cuda)``).

Importing this module changes nothing: the tree under test is first on PYTHONPATH (gpu_oneshot.sh puts it
there), a check finds its siblings beside its script, and the two that import from elsewhere in the tree
put that folder on ``sys.path`` themselves, in sight (oneshot_bench.py: benchmarks/; oneshot_runs.py:
recipes/). Nothing is imported from tests/ (tests/repo/test_house_rules.py).
"""

import json
import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

DRY_RUN = os.environ.get("ONESHOT_DRY_RUN") == "1"
WORK = Path(os.environ.get("ONESHOT_WORK", "/tmp/oneshot-work"))
LOGS = WORK / "logs"


def sized(gpu, dry):
    """The GPU run's value, or the dry run's."""
    return dry if DRY_RUN else gpu


def left() -> float:
    """Seconds until this check's deadline."""
    return float(os.environ.get("ONESHOT_DEADLINE", time.time() + 3600)) - time.time()


def emit(status: str, name: str, text: str = "", **figures) -> bool:
    """Append ``STATUS name: text [card: ...]`` to the summary (and print it) and the figures as one JSON
    line; the card (name and memory, or "cpu, dry run") comes from gpu_oneshot.sh (ONESHOT_CARD).
    Returns whether the status is PASS (or INFO), so callers can count failures."""
    line = f"{f'{status} {name}: {text}'.rstrip(': ')} [card: {os.environ.get('ONESHOT_CARD', '?')}]"
    print(line, flush=True)
    summary = os.environ.get("ONESHOT_SUMMARY")
    if summary:
        with open(summary, "a") as f:
            f.write(line + "\n")
    record = os.environ.get("ONESHOT_FIGURES")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"check": name, "status": status, "text": text, **figures}, default=str) + "\n")
    return status in ("PASS", "INFO")


def verdict(name: str, ok: bool, text: str, **figures) -> bool:
    return emit("PASS" if ok else "FAIL", name, text, **figures)


def skip_cuda(name: str, why: str = "needs a CUDA device") -> None:
    emit("SKIP", name, f"(cuda) {why}")


def out_of_time(name: str, needs: float) -> bool:
    """True (and a SKIP line) when less than ``needs`` seconds are left for ``name``."""
    if left() >= needs:
        return False
    emit("SKIP", name, f"(deadline) {max(left(), 0):.0f}s left, it needs about {needs:.0f}s")
    return True


def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() and not DRY_RUN else "cpu")


def rel_err(got, want) -> float:
    """max |got - want| / max |want| in float64 (0 when both are empty or zero)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if want.numel() == 0:
        return 0.0
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)


def run_guarded(name: str, fn, *args, **kw):
    """``fn(*args, **kw)``; an exception becomes a FAIL line naming it (the check goes on)."""
    try:
        return fn(*args, **kw)
    except Exception as error:  # noqa: BLE001 - the one-shot reports every failure and carries on
        import traceback

        traceback.print_exc()
        emit("FAIL", name, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300])
        return None
