#!/usr/bin/env python
"""One-shot step 5: the layer benchmark on the GPU (benchmarks/moe_layer.py's contenders, timed
the same way: medians of interleaved rounds).

* ceiling: a dense bf16 8192x8192x8192 matrix product measured here, in TFLOP/s;
* E=8 experts of d=2048, H=8192, k=2, 65536 tokens, bf16: the MoE layer (the kernel ``auto``
  picks, and the per-expert loop) against the floor (one dense FFN on the k*N token copies) and the
  dense FFN with the same active parameters; TFLOP/s and its share of the ceiling, x floor;
* E=64 experts of H=1024 (the same parameters, fine-grained): x floor and x expert floor (the 64
  GEMM pairs alone on the rows the router gives each);
* peak memory of one step of each, in this process (the growth of allocated memory over the step).
Figures only: these lines PASS when the timings are finite; what they mean is for the reader (no
GPU has produced them yet). The CPU dry run runs the same at toy sizes in fp32.
"""

import sys

import torch

from report import DRY_RUN, ROOT, device, emit, out_of_time, run_guarded, sized

sys.path.insert(0, str(ROOT / "benchmarks"))  # the CPU layer benchmark's modules, timed the same way here
from contenders import Shape, build_contender  # noqa: E402
from measure import median, peak_step_memory, synchronize, time_interleaved  # noqa: E402
from moe_layer import ffn_flops  # noqa: E402


def ceiling(dev, dtype):
    n = sized(8192, 256)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    times = time_interleaved({"gemm": lambda: torch.mm(a, b)}, reps=sized(10, 3), warmup=3, device=dev)["gemm"]
    tflops = 2 * n**3 / median(times) / 1e12
    emit(
        "PASS",
        "bench_ceiling",
        f"dense {str(dtype)[6:]} {n}^3 matrix product: {tflops:.3g} TFLOP/s (median of {len(times)})",
        tflops=tflops,
    )
    return tflops


def section(name, shape, dev, dtype, top, with_expert_floor):
    contenders = [build_contender("floor", shape, dev, dtype)]
    moes = [build_contender("moe", shape, dev, dtype, expert_matmul=m) for m in ("auto", "loop")]
    contenders += moes
    if with_expert_floor:
        contenders.append(build_contender("expert floor", shape, dev, dtype, counts=moes[0].expert_rows()))
    contenders.append(build_contender("dense", shape, dev, dtype))
    times = time_interleaved({c.name: c.step for c in contenders}, reps=sized(5, 2), warmup=2, device=dev)
    seconds = {n: median(t) for n, t in times.items()}
    memory = {}
    for c in contenders:
        memory[c.name] = peak_step_memory(c.step, dev) if dev.type == "cuda" else None
    synchronize(dev)
    flops = ffn_flops(shape)
    floor = seconds["floor"]
    rows = []
    for c in contenders:
        t = seconds[c.name]
        text = f"{c.name} {t * 1e3:.1f} ms, {flops / t / 1e12:.3g} TFLOP/s ({flops / t / 1e12 / top:.0%} of ceiling), x floor {t / floor:.2f}"
        if "expert floor" in seconds:
            text += f", x expert floor {t / seconds['expert floor']:.2f}"
        if memory[c.name] is not None:
            text += f", peak +{memory[c.name] / 2**20:.0f} MiB"
        rows.append(text)
    ok = all(t == t and t > 0 for t in seconds.values())
    emit(
        "PASS" if ok else "FAIL",
        name,
        f"{str(dtype)[6:]} d={shape.d_model} H={shape.hidden} E={shape.experts} k={shape.k} {shape.tokens} tokens: "
        + "; ".join(rows),
        seconds=seconds,
        memory_bytes=memory,
        flops=flops,
        ceiling_tflops=top,
    )
    del contenders, moes
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main():
    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.set_num_threads(1 if DRY_RUN else torch.get_num_threads())  # dry run: toy sizes, see gpu_oneshot.sh
    top = run_guarded("bench_ceiling", ceiling, dev, dtype)
    if top is None:
        return
    d, h, n = sized((2048, 8192, 65536), (64, 128, 512))
    shapes = [
        ("bench_layer[E=8]", Shape(d, h, 8, 2, n), False),
        ("bench_layer[E=64]", Shape(d, h // 8, 64, 2, n), True),
    ]
    for name, shape, expert_floor in shapes:
        if not out_of_time(name, sized(25, 5)):
            run_guarded(name, section, name, shape, dev, dtype, top, expert_floor)
    if DRY_RUN:
        emit("INFO", "bench_sizes", "dry run: toy sizes on CPU in fp32, timings mean nothing")


if __name__ == "__main__":
    main()
