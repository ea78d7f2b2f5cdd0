#!/usr/bin/env python
"""One-shot step 1: what the machine is (versions, capability, NCCL, nvidia-smi, the imports and
where they come from, the private torch APIs the plugin uses), then the plugin imported and an MoE
translation model built through fairseq's own parser and task under this torch, with one training
step (fp32, and bf16 autocast on CUDA) whose loss and gradients must be finite.

    python benchmarks/device/oneshot_env.py --import-only   # the import and the CPU model alone
"""

import argparse
import hashlib
import importlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from report import DRY_RUN, LOGS, ROOT, WORK, device, emit, run_guarded, skip_cuda, verdict


def torch_line():
    import torch

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    if torch.cuda.is_available() and not DRY_RUN:
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else "?"
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        parts += [
            f"CUDA {torch.version.cuda}",
            f"cuDNN {torch.backends.cudnn.version()}",
            f"NCCL {nccl}",
            f"{torch.cuda.device_count()} x {props.name}",
            f"sm{props.major}{props.minor}",
            f"{props.total_memory / 2**30:.1f} GiB",
            f"{props.multi_processor_count} SMs",
        ]
        ok = True
    else:
        parts.append("no CUDA device" + (" (dry run: CUDA hidden)" if DRY_RUN else ""))
        ok = DRY_RUN
    figures = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_devices": torch.cuda.device_count() if not DRY_RUN else 0,
    }
    if not ok:
        parts.append(
            f"torch.cuda.is_available() is False (torch built for CUDA {torch.version.cuda}): "
            "every CUDA check says SKIP (cuda)"
        )
    verdict("env_versions", ok, ", ".join(parts), **figures)


def nvidia_smi_line():
    if DRY_RUN:
        return skip_cuda("env_nvidia_smi")
    try:
        full = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        (LOGS / "nvidia-smi.txt").write_text(full.stdout + full.stderr)
        query = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit,temperature.gpu",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        verdict(
            "env_nvidia_smi", query.returncode == 0, query.stdout.strip().replace("\n", " | ") or query.stderr.strip()
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        emit("FAIL", "env_nvidia_smi", f"{type(error).__name__}: {error}")


def imports_line():
    from importlib.metadata import PackageNotFoundError, version

    found, missing = [], []
    for name, dist in (
        ("fairseq", "ve-fairseq"),
        ("hydra", "hydra-core"),
        ("omegaconf", "omegaconf"),
        ("bitarray", "bitarray"),
        ("antlr4", "antlr4-python3-runtime"),
        ("sacrebleu", "sacrebleu"),
        ("sentencepiece", "sentencepiece"),
        ("numpy", "numpy"),
    ):
        try:
            module = importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - reported
            missing.append(f"{name} ({type(error).__name__}: {error})")
            continue
        where = os.path.dirname(getattr(module, "__file__", "") or "?")
        site = (
            "carried"
            if where.startswith(str(WORK / "site"))
            else "machine"
            if "-packages" in where
            else "tree"
            if where.startswith(str(ROOT))
            else where
        )
        try:
            found.append(f"{name} {version(dist)} ({site})")
        except PackageNotFoundError:
            found.append(f"{name} {getattr(module, '__version__', '?')} ({site})")
    verdict("env_imports", not missing, "; ".join(found + [f"MISSING {m}" for m in missing]))


def plugin_wheel_line():
    """The plugin under test is the tree's; the carried wheel must hold the same files."""
    installed = WORK / "site" / "fairseq_moe_ext"
    if DRY_RUN or not installed.is_dir():
        return emit("SKIP", "env_plugin_wheel", "no carried fairseq_moe_ext wheel installed (the tree's plugin runs)")

    def digests(folder):
        return {
            p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }

    tree, wheel = digests(ROOT / "fairseq_moe_ext"), digests(installed)
    differ = sorted(n for n in tree.keys() | wheel.keys() if tree.get(n) != wheel.get(n))
    verdict(
        "env_plugin_wheel",
        not differ,
        "the carried wheel equals the tree"
        if not differ
        else f"{len(differ)} files differ from the tree (rerun prepare_wheels.sh): {', '.join(differ[:5])}",
    )


def private_api_line():
    from fairseq_moe_ext.moe.torch_compat import PRIVATE_APIS

    have = {name: bool(probe()) for name, probe in PRIVATE_APIS.items()}
    missing = [n for n, ok in have.items() if not ok]
    # A missing one has a fallback or a one-line refusal (README, "Torch versions"): INFO, not FAIL.
    emit(
        "INFO",
        "env_torch_private_apis",
        "all present" if not missing else f"missing (fallbacks in use): {missing}",
        apis=have,
    )


def fsdp_and_gloo_line():
    """What the two-rank verdicts rest on, probed on this torch with a one-rank gloo group on the CPU (no device
    time): FSDP2's setters and private state the plugin reads (common/torch_compat.py), and which reductions
    gloo takes (AVG: FSDP2's average; SUM: the plugin's replica sums; reduce-scatter: FSDP2's gradients)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from fairseq_moe_ext.common import torch_compat
    from fairseq_moe_ext.parallel.expert_sharding import NEEDED_SETTERS
    from fairseq_moe_ext.parallel.fully_sharded import fsdp_modules, shard_model

    store = dist.FileStore(str(WORK / "env_gloo_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        shard_model(model)
        model.layers[0](torch.ones(1, 4))
        unit = next(m for m in fsdp_modules(model) if torch_compat.fsdp_param_groups(m))
        found = {**torch_compat.fsdp_private_state(unit), **{s: hasattr(FSDPModule, s) for s in NEEDED_SETTERS}}
        for op in ("AVG", "SUM"):
            for collective in ("all_reduce", "reduce_scatter_tensor"):
                try:
                    x = torch.ones(2)
                    if collective == "all_reduce":
                        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                    else:
                        dist.reduce_scatter_tensor(torch.empty(2), x, op=getattr(dist.ReduceOp, op))
                    found[f"gloo {collective} {op}"] = True
                except (RuntimeError, ValueError):
                    found[f"gloo {collective} {op}"] = False
    finally:
        dist.destroy_process_group()
    missing = [name for name, ok in found.items() if not ok]
    emit("INFO", "env_fsdp_and_gloo", "all present" if not missing else f"missing: {missing}", found=found)


def write_dictionaries(folder: Path, vocab: int = 40) -> Path:
    from fairseq.data import Dictionary

    folder.mkdir(parents=True, exist_ok=True)
    for side, prefix in (("src", "s"), ("tgt", "t")):
        dictionary = Dictionary()
        for i in range(vocab):
            dictionary.add_symbol(f"{prefix}{i}")
        dictionary.save(str(folder / f"dict.{side}.txt"))
    return folder


def build_translation_model(data: Path, on_cpu: bool, *flags: str):
    """(task, model, criterion) as fairseq-train builds them from its command line."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import fairseq_moe_ext
    from fairseq import options, tasks, utils

    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [
            str(data),
            "--user-dir",
            fairseq_moe_ext.PACKAGE_DIR,
            "--task",
            "translation",
            "--source-lang",
            "src",
            "--target-lang",
            "tgt",
            "--arch",
            "moe_transformer_tiny",
            "--criterion",
            "moe_label_smoothed_cross_entropy",
            "--label-smoothing",
            "0.1",
            "--seed",
            "1",
            "--dropout",
            "0",
            *(["--cpu"] if on_cpu else []),
            *flags,
        ],
    )
    cfg = convert_namespace_to_omegaconf(args)
    utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    return task, task.build_model(cfg.model), task.build_criterion(cfg.criterion)


def translation_batch(task, lengths=(7, 3, 5, 9), seed=0):
    import torch
    from fairseq.data import LanguagePairDataset

    g = torch.Generator().manual_seed(seed)

    def sentences(d, ls):
        return [torch.cat([torch.randint(d.nspecial, len(d), (n,), generator=g), torch.tensor([d.eos()])]) for n in ls]

    src, tgt = sentences(task.src_dict, lengths), sentences(task.tgt_dict, lengths[::-1])
    dataset = LanguagePairDataset(src, [len(s) for s in src], task.src_dict, tgt, [len(t) for t in tgt], task.tgt_dict)
    return dataset.collater([dataset[i] for i in range(len(src))])


def model_step(model, criterion, sample, autocast_dtype=None):
    import torch

    model.train()
    model.zero_grad()
    dev = next(model.parameters()).device
    with torch.autocast(dev.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        loss, _, _ = criterion(model, sample)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(loss.detach()), all(bool(torch.isfinite(g).all()) for g in grads), len(grads)


def plugin_and_model(on_cpu: bool):
    started = time.time()
    import fairseq_cli.generate  # noqa: F401
    import fairseq_cli.preprocess  # noqa: F401
    import fairseq_cli.train  # noqa: F401
    import torch

    import fairseq  # noqa: F401
    import fairseq_moe_ext  # noqa: F401
    from fairseq import utils

    imported = time.time() - started
    dev = torch.device("cpu") if on_cpu else device()
    task, model, criterion = build_translation_model(write_dictionaries(WORK / "dicts"), dev.type == "cpu")
    model = model.to(dev)
    sample = utils.move_to_cuda(translation_batch(task)) if dev.type == "cuda" else translation_batch(task)
    steps = {"fp32": model_step(model, criterion, sample)}
    if dev.type == "cuda":
        steps["bf16 autocast"] = model_step(model, criterion, sample, torch.bfloat16)
    ok = all(finite and loss == loss and abs(loss) != float("inf") for loss, finite, _ in steps.values())
    said = "; ".join(
        f"{k} loss {loss:.4f}, {n} gradients {'finite' if finite else 'NOT finite'}"
        for k, (loss, finite, n) in steps.items()
    )
    return ok, (
        f"fairseq + plugin imported in {imported:.1f}s; moe_transformer_tiny ({sum(p.numel() for p in model.parameters())} "
        f"parameters) built by fairseq's parser and task on {dev}; one step: {said}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--import-only", action="store_true")
    args = parser.parse_args()
    if args.import_only:
        ok, said = plugin_and_model(on_cpu=True)
        print(("ok: " if ok else "FAILED: ") + said)
        sys.exit(0 if ok else 1)
    LOGS.mkdir(parents=True, exist_ok=True)
    result = run_guarded("env_plugin_model", plugin_and_model, False)  # first: nothing else matters if it fails
    if result is not None:
        verdict("env_plugin_model", *result)
    for line in (torch_line, nvidia_smi_line, imports_line, plugin_wheel_line, private_api_line, fsdp_and_gloo_line):
        run_guarded(line.__name__, line)


if __name__ == "__main__":
    main()
