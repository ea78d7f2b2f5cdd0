"""The one-shot's two-rank fairseq runs and generation, started beside the single-GPU runs (they came
last and were the likeliest to be cut by the deadline).

Two fairseq ranks on one GPU under torchrun over ``cuda:gloo`` (an emulation: NCCL will not put two
ranks on one device; with two GPUs or more, NCCL on two GPUs; the CPU dry run, gloo), each validated and
saved once, after its last update: ``legacy_ddp`` with --bf16, the reference the others are held to update
by update (oneshot_verdicts.py); ``c10d`` with --bf16, and ``fully_sharded --bf16``, which a build that
does not map --bf16 onto FSDP2 refuses in the plugin's one line: that refusal is recorded as the result
(INFO), not as a failure, and any other error is a failure; and
``fully_sharded --bf16`` with P = 1 < W = 2 and ``--moe-fully-sharded-experts sharded``, each MoE
layer's experts sharded over both ranks (their replica group; a P = 1 run saves one file, not a set). If the
legacy_ddp run fails over cuda:gloo, it is retried over cpu:gloo,cuda:gloo when time is left. As soon
as the legacy_ddp run has saved its set, one-process fairseq-generate starts from it.
"""

import re
import sys

from oneshot_runs import FALL, RUNS, failed_run, free_port, outcome, read_log, start, train_flags, wait_all
from oneshot_verdicts import refusal, track
from report import DRY_RUN, ROOT, emit, out_of_time, verdict

# The two-rank runs validate and save once, after their last update, not after every epoch.
ONCE = ["--validate-interval", "1000000", "--save-interval", "1000000"]

# name: the flags of a two-rank run besides the world size and the backend
KINDS = {
    "legacy": ["--ddp-backend", "legacy_ddp", "--bf16"],
    "c10d": ["--ddp-backend", "c10d", "--bf16"],
    "fully_sharded_bf16": ["--ddp-backend", "fully_sharded", "--bf16"],
    "fully_sharded_bf16_experts_sharded": [
        *["--ddp-backend", "fully_sharded", "--bf16"],
        *["--moe-expert-parallel-size", "1", "--moe-fully-sharded-experts", "sharded"],
    ],
}


def backend():
    import torch

    if DRY_RUN:
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= 2 else "cuda:gloo"


def run_name(kind, over):
    label = over.replace(":", "_").replace(",", "+")
    return f"two_ranks_{label}" if kind == "legacy" else f"two_ranks_{label}_{kind}"


def label_of(over):
    if DRY_RUN:
        return "dry run: 2 gloo ranks on CPU"
    return "2 GPUs over NCCL" if over == "nccl" else f"emulation: 2 ranks share one GPU over {over}"


def start_two_ranks(data, kind, over):
    name = run_name(kind, over)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]  # fmt: skip
    flags = [
        "--distributed-world-size",
        "2",
        *KINDS[kind],
        *ONCE,
        *([] if DRY_RUN else ["--distributed-backend", over]),
    ]
    return start(name, [*launcher, "-m", "fairseq_cli.train", *train_flags(data, RUNS / name, *flags)])


def judge(kind, over, status, legacy=None):
    """PASS/FAIL (INFO for the plugin's refusal) of one two-rank run, held update by update to the legacy_ddp
    run ``legacy`` (its run name; None: this is it); returns its save directory when it saved a set."""
    name = run_name(kind, over)
    result = outcome(name, status)
    said = refusal(read_log(name))
    if status not in (0, None) and said:
        emit("INFO", f"fairseq_{name}", f"({label_of(over)}) refused in one line before training: {said[:240]}")
        return None
    if failed_run(f"fairseq_{name}", result):
        return None
    train, valid = result[0], result[1]
    one_file = "--moe-fully-sharded-experts" in KINDS[kind]  # P = 1: every expert in one file
    saved = (RUNS / name / ("checkpoint_last.pt" if one_file else "checkpoint_last.set.json")).exists()
    what = f"bf16 {KINDS[kind][1]}" + (", experts sharded over both ranks" if one_file else "")
    alike, against = (True, "the reference of the others") if legacy is None else track(name, legacy, "bf16")
    verdict(
        f"fairseq_{name}",
        saved and train[-1] < FALL * train[0] and alike,
        f"({label_of(over)}) {what}: train {train[0]:.3f} -> {train[-1]:.3f}, valid {valid:.3f}; "
        f"{'one file' if one_file else 'per-rank set'} saved: {saved}; {against}",
    )
    return RUNS / name if saved else None


def start_generate(data, save_dir):
    command = [sys.executable, "-m", "fairseq_cli.generate", str(data), "--user-dir", str(ROOT / "fairseq_moe_ext")]
    command += ["--path", str(save_dir / "checkpoint_last.pt"), "--beam", "2", "--max-tokens", "2000"]
    command += ["--num-workers", "0", *(["--cpu"] if DRY_RUN else [])]
    return start("generate", command)


def judge_generate(save_dir, status):
    text = read_log("generate")
    hypotheses = len(re.findall(r"^H-\d+", text, re.MULTILINE))
    bleu = re.search(r"BLEU4? = ([\d.]+)", text)
    verdict(
        "fairseq_generate",
        status == 0 and hypotheses > 0,
        f"one process from the 2-rank set {save_dir.name}: exit {status}, {hypotheses} hypotheses, "
        f"BLEU {bleu.group(1) if bleu else '?'}",
    )


def legacy_then_generate(data, over, legacy):
    """Wait for the legacy_ddp run (retried over cpu:gloo,cuda:gloo if cuda:gloo failed), then
    generate from its set. Returns the generation run to wait for (or None), the set, and the run the
    other two-rank runs are held to (None without one)."""
    status = wait_all([legacy])[legacy[0]]
    save_dir, reference = judge("legacy", over, status), legacy[0]
    if save_dir is None and over == "cuda:gloo" and not out_of_time("fairseq_two_ranks_cpu_gloo+cuda_gloo", 40):
        emit("INFO", f"fairseq_{legacy[0]}", f"({label_of(over)}) did not run through: trying cpu:gloo,cuda:gloo")
        retry = start_two_ranks(data, "legacy", "cpu:gloo,cuda:gloo")
        save_dir, reference = judge("legacy", "cpu:gloo,cuda:gloo", wait_all([retry])[retry[0]]), retry[0]
    if save_dir is None:
        emit("SKIP", "fairseq_generate", "no two-rank set was saved to generate from")
        return None, None, None
    if out_of_time("fairseq_generate", 15):
        return None, None, reference
    return start_generate(data, save_dir), save_dir, reference
