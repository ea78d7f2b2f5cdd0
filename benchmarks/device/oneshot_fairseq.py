#!/usr/bin/env python
"""One-shot step 6: fairseq-train / fairseq-generate with the plugin, as users run them.

* one GPU, the same seed and data: fp32, --fp16, --bf16 and --amp (and fp32 with another seed, the
  run-to-run yardstick), all at once on the GPU. Each low-precision run passes when its last train
  loss and its final valid loss are within 3% (fp16, amp) or 5% (bf16) of fp32's, with at most
  max(3, 5% of updates) skipped steps (fairseq's "gradient overflow" / "AMP: skipping" lines);
* one bf16 run combining a capacity factor, batch-prioritised routing, a shared expert, bias
  balancing and activation checkpointing: it must finish with a loss that fell by 30% (dry run: 5%);
* two --moe-deterministic bf16 runs: their checkpoints must be bit-identical;
* two fairseq ranks on one GPU over cuda:gloo under torchrun (an emulation: NCCL will not put two
  ranks on one device), then, if that fails, over cpu:gloo,cuda:gloo (each outcome said); with two
  GPUs or more, over NCCL on two GPUs; then one-process fairseq-generate from the set they saved.
The CPU dry run: tiny runs with --cpu (fp16 and amp need CUDA: SKIP), gloo for the two ranks.
The corpus is tests/support/fairseq_helpers.py's generated translation task, larger on the GPU.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
import types

from report import DRY_RUN, LOGS, ROOT, WORK, emit, left, out_of_time, run_guarded, sized, skip_cuda, verdict

RUNS = WORK / "runs"
UPDATES = sized(300, 12)
BOUNDS = {"fp16": 0.03, "amp": 0.03, "bf16": 0.05}
FALL = sized(0.7, 0.95)  # the last train loss at most this times the first (the dry run trains 12 updates)
# fmt: off
COMBINED = ["--bf16", "--moe-capacity-factor", "1.25", "--moe-batch-prioritized-routing",
            "--moe-shared-expert-count", "1", "--moe-balance", "bias", "--moe-bias-update-rate", "1e-3",
            "--checkpoint-activations"]
# fmt: on


def corpus():
    """Write and binarize the corpus (fairseq-preprocess's own main, in this process)."""
    try:
        import pytest  # noqa: F401  (fairseq_helpers reports a failed preprocess through pytest.fail)
    except ImportError:

        def fail(message, pytrace=True):
            raise SystemExit(message)

        sys.modules["pytest"] = types.SimpleNamespace(fail=fail, mark=types.SimpleNamespace())
    import fairseq_helpers

    fairseq_helpers.SPLITS = sized({"train": 4000, "valid": 200, "test": 64}, {"train": 300, "valid": 20, "test": 8})
    data = fairseq_helpers.preprocess_parallel(fairseq_helpers.write_parallel_corpus(WORK / "raw"), WORK / "bin")
    return data


def env():
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    if DRY_RUN:
        e.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return e


def train_flags(data, save_dir, *extra, seed=1):
    import fairseq_moe_ext

    fixed = (
        "--arch moe_transformer_tiny --criterion moe_label_smoothed_cross_entropy --label-smoothing 0.1 "
        "--optimizer adam --lr 3e-3 --lr-scheduler inverse_sqrt --warmup-updates 30 --clip-norm 1.0 "
        "--num-workers 0 --no-epoch-checkpoints --log-format json"
    ).split()
    return [
        *[str(data), "--user-dir", fairseq_moe_ext.PACKAGE_DIR, *fixed, "--save-dir", str(save_dir)],
        *["--max-tokens", str(sized(2000, 400)), "--max-update", str(UPDATES), "--seed", str(seed)],
        *["--log-interval", str(sized(20, 4)), *(["--cpu"] if DRY_RUN else []), *extra],
    ]


def start(name, command):
    log = open(LOGS / "fairseq" / f"{name}.log", "w")
    return (
        name,
        subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=str(WORK), start_new_session=True
        ),
        log,
    )


def wait_all(started, margin=20):
    """{name: exit status, None if killed at the deadline}."""
    status = {}
    for name, process, log in started:
        try:
            status[name] = process.wait(timeout=max(left() - margin, 1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            status[name] = None
        log.close()
    return status


def read_log(name):
    return (LOGS / "fairseq" / f"{name}.log").read_text(errors="replace")


def records(text, tag):
    pattern = re.compile(rf"\| {tag} \| (\{{.*\}})\s*$")
    return [json.loads(m.group(1)) for line in text.splitlines() if (m := pattern.search(line))]


def outcome(name, status):
    """(train losses, final valid loss, skipped steps, last line) of one run."""
    text = read_log(name)
    train = [float(r["loss"]) for r in records(text, "train_inner")]
    valid = [float(r["valid_loss"]) for r in records(text, "valid")]
    skipped = len(re.findall(r"gradient overflow detected|AMP: skipping this batch", text))
    last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
    return train, (valid[-1] if valid else None), skipped, status, last[0][-200:]


def failed_run(name, result):
    train, valid, _, status, last = result
    if status == 0 and train and valid is not None:
        return False
    said = "killed at the deadline" if status is None else f"exit {status}"
    emit("FAIL", name, f"{said}, {len(train)} train records, valid {valid}: {last}")
    return True


def precision_runs(data):
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
    if DRY_RUN:
        for name in ("fp16", "amp", "fp32_seed2"):
            plan.pop(name)
    started = [
        start(
            name,
            [
                sys.executable,
                "-m",
                "fairseq_cli.train",
                *train_flags(data, RUNS / name, *flags, seed=2 if name == "fp32_seed2" else 1),
            ],
        )
        for name, flags in plan.items()
    ]
    began = time.time()
    status = wait_all(started)
    results = {name: outcome(name, status[name]) for name in plan}
    emit(
        "INFO",
        "fairseq_runs",
        f"{len(plan)} runs of {UPDATES} updates side by side on "
        f"{'the CPU' if DRY_RUN else 'one GPU'} in {time.time() - began:.0f}s",
    )
    return results


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
    if "fp32_seed2" in results and not failed_run("fairseq_fp32_seed2", results["fp32_seed2"]):
        t, v = results["fp32_seed2"][0][-1], results["fp32_seed2"][1]
        emit(
            "INFO",
            "fairseq_fp32_seed2",
            f"run-to-run yardstick, another seed: train {t:.3f} "
            f"({abs(t - train32) / train32:.1%} from fp32), valid {v:.3f} ({abs(v - valid32) / valid32:.1%})",
        )
    for precision, bound in BOUNDS.items():
        name = f"fairseq_{precision}"
        if precision not in results:
            skip_cuda(name, f"--{precision} needs CUDA in one process (fairseq's fp16 buffers, the amp scaler)")
            continue
        if failed_run(name, results[precision]):
            continue
        train, valid, skipped, _, _ = results[precision]
        d_train, d_valid = abs(train[-1] - train32) / train32, abs(valid - valid32) / valid32
        storm = max(3, 0.05 * UPDATES)
        verdict(
            name,
            d_train <= bound and d_valid <= bound and skipped <= storm,
            f"train {train[-1]:.3f} ({d_train:.1%} from fp32), valid {valid:.3f} ({d_valid:.1%}), bound {bound:.0%}; "
            f"{skipped} skipped steps (at most {storm:.0f})",
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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(data):
    import torch

    if DRY_RUN:
        backends = ["gloo"]
    elif torch.cuda.device_count() >= 2:
        backends = ["nccl"]  # a real two-GPU run where the machine has two
    else:
        backends = ["cuda:gloo", "cpu:gloo,cuda:gloo"]
    for backend in backends:
        name = f"two_ranks_{backend.replace(':', '_').replace(',', '+')}"
        if out_of_time(f"fairseq_{name}", 40):
            return None
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        two = ["--distributed-world-size", "2", "--ddp-backend", "legacy_ddp", "--bf16"]
        backend_flags = [] if DRY_RUN else ["--distributed-backend", backend]
        command = [*launcher, "--master_port", str(free_port()), "-m", "fairseq_cli.train"]
        command += train_flags(data, RUNS / name, *two, *backend_flags)
        status = wait_all([start(name, command)])[name]
        result = outcome(name, status)
        label = (
            "dry run: 2 gloo ranks on CPU"
            if DRY_RUN
            else "2 GPUs over NCCL"
            if backend == "nccl"
            else f"emulation: 2 ranks share one GPU over {backend}"
        )
        if not failed_run(f"fairseq_{name}", result):
            train, valid = result[0], result[1]
            set_file = RUNS / name / "checkpoint_last.set.json"
            verdict(
                f"fairseq_{name}",
                set_file.exists() and train[-1] < FALL * train[0],
                f"({label}) bf16 legacy_ddp: train {train[0]:.3f} -> {train[-1]:.3f}, valid {valid:.3f}; "
                f"per-rank set saved: {set_file.exists()}",
            )
            return RUNS / name
        emit(
            "INFO",
            f"fairseq_{name}",
            f"({label}) did not run through: see logs/fairseq/{name}.log"
            + ("; trying the next backend" if backend != backends[-1] else ""),
        )
    return None


def generate(data, save_dir):
    name = "generate"
    if save_dir is None:
        return emit("SKIP", f"fairseq_{name}", "no two-rank set was saved to generate from")
    if out_of_time(f"fairseq_{name}", 15):
        return
    command = [sys.executable, "-m", "fairseq_cli.generate", str(data), "--user-dir", str(ROOT / "fairseq_moe_ext")]
    command += ["--path", str(save_dir / "checkpoint_last.pt"), "--beam", "2", "--max-tokens", "2000"]
    command += ["--num-workers", "0", *(["--cpu"] if DRY_RUN else [])]
    status = wait_all([start(name, command)], margin=5)[name]
    text = read_log(name)
    hypotheses = len(re.findall(r"^H-\d+", text, re.MULTILINE))
    bleu = re.search(r"BLEU4? = ([\d.]+)", text)
    verdict(
        f"fairseq_{name}",
        status == 0 and hypotheses > 0,
        f"one process from the 2-rank set {save_dir.name}: exit {status}, {hypotheses} hypotheses, "
        f"BLEU {bleu.group(1) if bleu else '?'}",
    )


def main():
    (LOGS / "fairseq").mkdir(parents=True, exist_ok=True)
    RUNS.mkdir(parents=True, exist_ok=True)
    data = run_guarded("fairseq_corpus", corpus)
    if data is None:
        return
    results = run_guarded("fairseq_runs", precision_runs, data)
    if results:
        run_guarded("fairseq_precisions", judge_precisions, results)
        run_guarded("fairseq_combined_bf16", judge_combined, results)
        run_guarded("fairseq_deterministic", judge_deterministic, results)
    save_dir = run_guarded("fairseq_two_ranks", two_ranks, data)
    run_guarded("fairseq_generate", generate, data, save_dir)


if __name__ == "__main__":
    main()
