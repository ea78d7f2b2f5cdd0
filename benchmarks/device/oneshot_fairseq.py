#!/usr/bin/env python
"""One-shot step 6: fairseq-train / fairseq-generate with the plugin, as users run them, every run
started at once (one intra-op thread each) so that none waits for another to be cut by the deadline.

* one GPU, the same seed and data: fp32, --fp16, --bf16 and --amp (and fp32 with another seed, the
  run-to-run yardstick). Each low-precision run passes when its last train loss and its final valid
  loss are within twice the two fp32 seeds' spread of fp32's (at least 1%), its first updates' losses and
  gradient norms follow the fp32 run's (oneshot_verdicts.py), with at most max(3, 5% of updates) skipped
  steps (fairseq's "gradient overflow" / "AMP: skipping" lines);
* one bf16 run combining a capacity factor, batch-prioritised routing, a shared expert, bias
  balancing and activation checkpointing: it must finish with a loss that fell by 30% (dry run: 5%);
* two --moe-deterministic bf16 runs: their checkpoints must be bit-identical;
* beside them, the two-rank runs and generation of oneshot_ranks.py (legacy_ddp, c10d and
  fully_sharded --bf16, with experts whole and sharded over their replica group, over cuda:gloo;
  generation from the legacy_ddp set as soon as it is saved).
Every run still alive when the check ends is killed (``finally``). The CPU dry run: tiny runs with
--cpu (fp16 and amp need CUDA: SKIP), gloo for the two ranks; with ONESHOT_PLANT, only the planted runs
(oneshot_plant.py) and the runs they are held to. The corpus is
recipes/toy_pair.py's generated translation task, larger on the GPU.
"""

import signal
import sys
import time

from oneshot_ranks import KINDS, backend, judge, judge_generate, legacy_then_generate, run_name, start_two_ranks
from oneshot_runs import (
    FALL,
    PLANTED,
    RUNS,
    UPDATES,
    corpus,
    failed_run,
    kill_started,
    outcome,
    start,
    train_flags,
    wait_all,
)
from oneshot_verdicts import SPREAD_FLOOR, spread_bound, track
from report import DRY_RUN, LOGS, emit, run_guarded, skip_cuda, verdict

PRECISIONS = ("fp16", "amp", "bf16")
# fmt: off
COMBINED = ["--bf16", "--moe-capacity-factor", "1.25", "--moe-batch-prioritized-routing",
            "--moe-shared-expert-count", "1", "--moe-balance", "bias", "--moe-bias-update-rate", "1e-3",
            "--checkpoint-activations"]
# fmt: on


def start_precision_runs(data):
    plan = {
        "fp32": [],
        "fp32_seed2": [],
        "bf16": ["--bf16"],
        "fp16": ["--fp16"],
        "amp": ["--amp"],
        "combined_bf16": COMBINED,
        "deterministic_1": ["--bf16", "--moe-deterministic"],
        "deterministic_2": ["--bf16", "--moe-deterministic"],
    }
    if DRY_RUN:  # fp32 with another seed stays: the precision verdicts read the two fp32 seeds' spread
        for name in ("fp16", "amp"):
            plan.pop(name)
    if PLANTED:  # a planted dry run: the planted runs and the fp32 runs they are held to
        plan = {name: flags for name, flags in plan.items() if name in PLANTED or name.startswith("fp32")}
    command = [sys.executable, "-m", "fairseq_cli.train"]
    return [
        start(name, [*command, *train_flags(data, RUNS / name, *flags, seed=2 if name == "fp32_seed2" else 1)])
        for name, flags in plan.items()
    ]


def judge_precisions(results):
    if "fp32" not in results or failed_run("fairseq_fp32", results["fp32"]):
        return
    train32, valid32 = results["fp32"][0][-1], results["fp32"][1]
    emit(
        "PASS",
        "fairseq_fp32",
        f"baseline: last train loss {train32:.3f} (first {results['fp32'][0][0]:.3f}), "
        f"valid {valid32:.3f} after {UPDATES} updates",
        train=train32,
        valid=valid32,
    )
    seed2 = "fp32_seed2" in results and not failed_run("fairseq_fp32_seed2", results["fp32_seed2"])
    if seed2:
        t, v = results["fp32_seed2"][0][-1], results["fp32_seed2"][1]
        emit(
            "INFO",
            "fairseq_fp32_seed2",
            f"run-to-run yardstick, another seed: train {t:.3f} "
            f"({abs(t - train32) / train32:.1%} from fp32), valid {v:.3f} ({abs(v - valid32) / valid32:.1%})",
        )
    if not seed2:
        emit("FAIL", "fairseq_precisions", "no second fp32 seed: the precisions have no spread to be held to")
        return
    bound, spread = spread_bound((train32, valid32), (results["fp32_seed2"][0][-1], results["fp32_seed2"][1]))
    for precision in PRECISIONS:
        name = f"fairseq_{precision}"
        if precision not in results:
            skip_cuda(name, f"--{precision} needs CUDA in one process (fairseq's fp16 buffers, the amp scaler)")
            continue
        if failed_run(name, results[precision]):
            continue
        train, valid, skipped, _, _ = results[precision]
        d_train, d_valid = abs(train[-1] - train32) / train32, abs(valid - valid32) / valid32
        storm = max(3, 0.05 * UPDATES)
        alike, against = track(precision, "fp32", precision)
        verdict(
            name,
            d_train <= bound and d_valid <= bound and skipped <= storm and alike,
            f"train {train[-1]:.3f} ({d_train:.1%} from fp32), valid {valid:.3f} ({d_valid:.1%}), bound {bound:.1%} "
            f"(twice the fp32 seeds' {spread:.1%}, at least {SPREAD_FLOOR:.0%}); {skipped} skipped steps (at most "
            f"{storm:.0f}); {against}",
            train=train[-1],
            valid=valid,
            skipped=skipped,
        )


def judge_combined(results):
    if failed_run("fairseq_combined_bf16", results["combined_bf16"]):
        return
    train, valid, skipped, _, _ = results["combined_bf16"]
    verdict(
        "fairseq_combined_bf16",
        train[-1] <= FALL * train[0],
        f"bf16 + capacity 1.25 + batch-prioritised + 1 shared expert + bias balancing + activation checkpointing: "
        f"train {train[0]:.3f} -> {train[-1]:.3f} (must fall {1 - FALL:.0%}), valid {valid:.3f}, {skipped} skipped",
    )


def same_checkpoints(first, second):
    import torch

    from fairseq_moe_ext.checkpoint import CHECKPOINT_SAFE_GLOBALS

    with torch.serialization.safe_globals(CHECKPOINT_SAFE_GLOBALS):
        a = torch.load(first / "checkpoint_last.pt", weights_only=True, map_location="cpu")["model"]
        b = torch.load(second / "checkpoint_last.pt", weights_only=True, map_location="cpu")["model"]
    differ = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    return len(a), differ


def judge_deterministic(results):
    if any(failed_run(f"fairseq_{n}", results[n]) for n in ("deterministic_1", "deterministic_2")):
        return
    count, differ = same_checkpoints(RUNS / "deterministic_1", RUNS / "deterministic_2")
    verdict(
        "fairseq_deterministic",
        not differ,
        f"two --moe-deterministic --bf16 runs: {count - len(differ)}/{count} "
        f"tensors of checkpoint_last.pt bit-identical{'; first differing: ' + differ[0] if differ else ''}",
    )


def _stop(signum, frame):
    raise SystemExit(128 + signum)  # so that the finally below kills the runs


def main():
    signal.signal(signal.SIGTERM, _stop)
    (LOGS / "fairseq").mkdir(parents=True, exist_ok=True)
    RUNS.mkdir(parents=True, exist_ok=True)
    data = run_guarded("fairseq_corpus", corpus)
    if data is None:
        return
    try:
        began, over = time.time(), backend()
        single = run_guarded("fairseq_runs", start_precision_runs, data) or []
        kinds = [k for k in KINDS if not PLANTED or k == "legacy" or run_name(k, over) in PLANTED]
        ranks = {kind: start_two_ranks(data, kind, over) for kind in kinds}
        # The legacy_ddp run first: generation starts from its set while the others still run.
        generation, save_dir, legacy = run_guarded("fairseq_two_ranks", legacy_then_generate, data, over, ranks.pop("legacy")) or (None, None, None)  # fmt: skip
        status = wait_all([*single, *ranks.values(), *([generation] if generation else [])])
        emit(
            "INFO",
            "fairseq_runs",
            f"{len(single)} single-process runs of {UPDATES} updates, {len(kinds)} two-rank runs and generation "
            f"side by side on {'the CPU' if DRY_RUN else 'one GPU'} in {time.time() - began:.0f}s",
        )
        results = {name: outcome(name, status[name]) for name, _ in single}
        if results:
            run_guarded("fairseq_precisions", judge_precisions, results)
            if "combined_bf16" in results:
                run_guarded("fairseq_combined_bf16", judge_combined, results)
            if "deterministic_1" in results:
                run_guarded("fairseq_deterministic", judge_deterministic, results)
        for kind, (name, _) in ranks.items():
            if legacy is None:
                emit("FAIL", f"fairseq_{name}", "no two-rank legacy_ddp run to hold it to")
                continue
            run_guarded(f"fairseq_{name}", judge, kind, over, status[name], legacy)
        if generation:
            run_guarded("fairseq_generate", judge_generate, save_dir, status[generation[0]])
    finally:
        kill_started()


if __name__ == "__main__":
    main()
