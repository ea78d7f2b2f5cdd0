#!/usr/bin/env python
"""Peak host memory of loading a checkpoint set for generation, per worker, against the bytes that worker keeps.

    python benchmarks/load_memory.py                       # sizes S and M, fp16 files (as NLLB-200 MoE's)

Writes a 2-rank set of an ``moe_transformer`` (fp16 weights, and Adam moments in every file as training writes
them), then, each in a fresh process, loads it through fairseq's own ``load_model_ensemble_and_task`` as
``fairseq-generate`` does: one process holding every expert in ``--bf16`` (a cast from the files' fp16), and 2
torchrun workers with the experts sharded in ``--fp16`` (worker 1 reads file 0 for the shared state, whose
experts it does not keep). Peak: the process's VmHWM above its VmRSS before the load (high-water mark reset,
Linux), file pages it mapped included. Kept: the bytes of the loaded model's parameters and buffers.

before: the same load with this change's three parts switched off in the measuring process (experts built in
        fp32 and initialised, then copied into; files read whole, not mapped; a worker's own experts copied out of
        its file), i.e. what the plugin did until this change.
after:  experts built on ``meta`` and the checkpoint's tensors taken as them in the dtype they run in, the other
        parameters built in that dtype, files memory-mapped.
"""

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MB = 1 << 20
# name: (model dim, expert hidden dim, experts, layers per side, vocabulary)
SIZES = {"S": (256, 1024, 8, 2, 4000), "M": (512, 2048, 16, 2, 8000)}


def write_set(directory: str, size: str) -> str:
    """A 2-rank set of an moe_transformer of ``size``, built by fairseq and saved in fp16: its manifest."""
    from fairseq.data import Dictionary
    from omegaconf import OmegaConf

    from fairseq import options, tasks
    from fairseq_moe_ext import checkpoint as moe_ckpt
    from fairseq_moe_ext.fairseq_integration import run_dtype

    dim, hidden, experts, layers, vocab = SIZES[size]
    for side in ("src", "tgt"):
        dictionary = Dictionary()
        for i in range(vocab):
            dictionary.add_symbol(f"{side}{i}")
        dictionary.save(os.path.join(directory, f"dict.{side}.txt"))
    # fmt: off
    argv = [directory, "--user-dir", os.path.join(ROOT, "fairseq_moe_ext"), "--task", "translation", "--source-lang",
            "src", "--target-lang", "tgt", "--arch", "moe_transformer_tiny", "--encoder-embed-dim", str(dim),
            "--decoder-embed-dim", str(dim), "--encoder-ffn-embed-dim", str(hidden), "--decoder-ffn-embed-dim",
            str(hidden), "--encoder-layers", str(layers), "--decoder-layers", str(layers), "--moe-freq", "1",
            "--moe-expert-count", str(experts), "--optimizer", "adam", "--lr", "1e-3", "--cpu"]
    # fmt: on
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    with run_dtype.built_for_load(None):  # noqa: SIM117  (meta experts, filled right below)
        model = task.build_model(cfg.model)
    names = [n for n, _ in model.named_parameters()]
    state_model = {}
    for name, tensor in model.state_dict().items():
        real = torch.randn(tensor.shape) * 0.02 if tensor.is_meta or tensor.is_floating_point() else tensor
        state_model[name] = real.half() if real.is_floating_point() and "balance_bias" not in name else real
    expert_keys = [n for n in names if ".experts." in n]
    moments = {i: {"exp_avg": state_model[n].clone(), "exp_avg_sq": state_model[n].abs()} for i, n in enumerate(names)}
    state = {
        "args": None,
        "cfg": OmegaConf.to_container(cfg, resolve=True),
        "model": state_model,
        "optimizer_history": [
            {"num_updates": 1, "optimizer_name": "Adam", "best_loss": None, "lr_scheduler_state": {}}
        ],
        "last_optimizer_state": {"state": moments, "param_groups": [{"params": list(range(len(names)))}]},
        "extra_state": {"epoch": 1, "train_iterator": {"epoch": 1}, "val_loss": None},
        "moe": moe_ckpt.moe_metadata(names, expert_keys, 1, 0, 1, experts_per_worker=experts),
    }
    return moe_ckpt.save_set(state, os.path.join(directory, "checkpoint_last"), 2)


def switched_off():
    """This change's parts switched off in this process (the 'before' column)."""
    from fairseq_moe_ext.checkpoint import reshard, safe_load
    from fairseq_moe_ext.fairseq_integration import loading

    loading.built_for_load = lambda dtype: contextlib.nullcontext()
    safe_load.mapping_loads_of = lambda path: contextlib.nullcontext()
    reshard.taken = lambda tensor, held, start, count: tensor[start : start + count].clone()


def measure(directory: str, precision: str, before: bool) -> None:
    """In a fresh process (a torchrun worker, or alone): load the set as fairseq-generate does, print JSON."""
    import fairseq_moe_ext  # noqa: F401  (its hooks before the command line is parsed, as --user-dir does)
    from fairseq import checkpoint_utils, options

    if before:
        switched_off()
    workers = int(os.environ.get("WORLD_SIZE", "1"))
    path = os.path.join(directory, "checkpoint_last.pt")
    argv = [directory, "--user-dir", os.path.join(ROOT, "fairseq_moe_ext"), "--path", path, "--cpu", f"--{precision}"]
    options.parse_args_and_arch(options.get_generation_parser(), argv + ["--distributed-world-size", str(workers)])
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark (not ru_maxrss: it survives exec)
        f.write("5")
    start = status_kib("VmRSS")
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([path])
    peak = (status_kib("VmHWM") - start) * 1024
    model = models[0]
    kept = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in model.state_dict().values()}.values())
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    print(json.dumps({"rank": int(os.environ.get("RANK", "0")), "peak": peak, "kept": kept, "dtypes": dtypes}))


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def run_row(directory: str, workers: int, precision: str, before: bool):
    """Each worker's {"peak", "kept", "dtypes"} from fresh processes."""
    command = [__file__, "--measure", directory, precision] + (["--before"] if before else [])
    if workers > 1:
        command = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(workers), *command]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"measurement failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [
        json.loads(found) for found in re.findall(r'\{"rank"[^{}]*\}', done.stdout)
    ]  # workers' lines may interleave
    return sorted(rows, key=lambda r: r["rank"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--measure", nargs=2, metavar=("DIR", "PRECISION"), help=argparse.SUPPRESS)
    parser.add_argument("--before", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(*args.measure, before=args.before)
        return 0
    if not os.path.exists("/proc/self/clear_refs"):
        print("needs Linux's /proc/self/clear_refs and VmHWM to measure peak memory", file=sys.stderr)
        return 2
    print(f"{'size':>4} {'load':<26} {'worker':>6} {'kept MiB':>9} {'before MiB':>10} {'ratio':>6} "
          f"{'after MiB':>9} {'ratio':>6}  dtype")  # fmt: skip
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as directory:
            write_set(directory, size)
            for workers, precision, label in (
                (1, "bf16", "one process, --bf16"),
                (2, "fp16", "2 workers sharded, --fp16"),
            ):
                old, new = (run_row(directory, workers, precision, before) for before in (True, False))
                for was, now in zip(old, new):
                    assert was["kept"] == now["kept"] and was["dtypes"] == now["dtypes"], (was, now)
                    print(
                        f"{size:>4} {label:<26} {now['rank']:>6} {now['kept'] / MB:>9.1f} {was['peak'] / MB:>10.1f} "
                        f"{was['peak'] / was['kept']:>6.2f} {now['peak'] / MB:>9.1f} {now['peak'] / now['kept']:>6.2f}"
                        f"  {','.join(now['dtypes'])}"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
