#!/usr/bin/env python
"""torch._grouped_mm experts against the per-expert loop in bf16, incl. idle experts and a rank with no rows.
usage: python benchmarks/grouped_mm_check.py [--device cuda|cpu]   (exit 2: no CUDA; exit 1: a mismatch)"""
import argparse, os, sys  # noqa: E401
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fairseq_moe_ext.moe import BatchedExperts  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
device = parser.parse_args().device
if (device == "cuda" and not torch.cuda.is_available()) or not hasattr(torch, "_grouped_mm"):
    print(f"grouped_mm_check: torch {torch.__version__} has no CUDA device or no torch._grouped_mm: "
          f"run on a GPU, or pass --device cpu for a dry check", file=sys.stderr)
    sys.exit(2)
failed = 0
for counts in ([96, 0, 320, 8, 0, 64, 512, 24], [0] * 8, [1, 0, 0, 7, 0, 0, 0, 0]):  # idle experts; a rank with no rows
    torch.manual_seed(0)
    runs = []
    for matmul in ("loop", "grouped_mm", "grouped_mm"):  # the grouped path twice: it must repeat bit for bit
        experts = BatchedExperts(256, 512, len(counts), matmul=matmul, seed=1, activation="gelu").to(device, torch.bfloat16)
        x = torch.randn(sum(counts), 256, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
        upstream = torch.randn(sum(counts), 256, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
        x.requires_grad_()
        (experts(x, counts).float() * upstream.float()).sum().backward()
        runs.append([experts(x, counts).detach(), x.grad] + [p.grad for p in experts.parameters()])
    names = ["y", "grad x"] + [n for n, _ in experts.named_parameters()]
    for name, loop, grouped, again in zip(names, *runs):
        err = (grouped.float() - loop.float()).abs().max().item() if loop.numel() else 0.0
        scale = loop.float().abs().max().item() if loop.numel() else 0.0
        idle = [i for i, c in enumerate(counts) if c == 0] if name.startswith("batched") else []
        ok = err <= 2e-2 * max(scale, 1e-3) and torch.equal(grouped, again) and not grouped[idle].any()
        failed += not ok
        print(f"{str(counts):40} {name:14} max|grouped-loop| {err:.3e} (scale {scale:.3e}) repeat-bitwise "
              f"{torch.equal(grouped, again)} {'ok' if ok else 'MISMATCH'}")
sys.exit(1 if failed else 0)
