#!/usr/bin/env python
"""Forward+backward cost of our MoE layer against what it cannot avoid, and against alternatives.

    python benchmarks/moe_layer.py --quick            # < 2 min on 2 CPU cores
    python benchmarks/moe_layer.py                    # full sweeps
    python benchmarks/moe_layer.py --device cuda --dtype bf16

Sections: (1) default shapes: MoE, the floor (a dense FFN of hidden H on the k*N token copies, in
one call), a dense FFN with the same active parameters (hidden k*H on N tokens), and fairscale's
MOELayer with Top2Gate; (2) cost against tokens (must grow linearly) and experts; (3) skewed
routing (one expert takes 4x its fair share) on the dropless path; (4) the capacity path (a fixed
capacity factor, slots over it dropped) against dropless and fairscale, whose Top2Gate capacity
2N/E equals our cf=1; (5) peak memory of one step; (6) many small experts (E=64 by default) against the floor, the
same E GEMM pairs timed alone ("expert floor") and the dense FFN; (0), first, the census: collectives and host
syncs of one layer call by mode on 2 gloo workers (``--no-census`` skips it).
Times are medians of interleaved repetitions; ratios are to the floor measured alongside.
"""

import argparse
import datetime
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from contenders import Shape, build_contender, fits_fairscale, import_fairscale  # noqa: E402
from measure import machine_summary, median, spread, time_interleaved  # noqa: E402
from moe_layer_census import census_section  # noqa: E402
from moe_layer_memory import memory_probe, memory_section  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sweeps and few repetitions (< 2 min on 2 cores)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads on CPU (default 2)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048, help="hidden size H of each expert")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, help="timed repetitions (default 7, quick 3)")
    p.add_argument("--warmup", type=int, help="untimed rounds first (default 2, quick 1)")
    p.add_argument("--token-sweep", type=int, nargs="*", help="token counts (default 1k..16k)")
    p.add_argument("--expert-sweep", type=int, nargs="*", help="expert counts (default 4..64)")
    p.add_argument(
        "--many-experts", type=int, default=64, help="expert count of the many-experts section (default 64; 0 skips it)"
    )
    p.add_argument("--skew", type=float, default=4.0, help="busiest expert's load over its fair share")
    p.add_argument(
        "--capacity-factors",
        type=float,
        nargs="*",
        default=[1.0, 1.25],
        help="capacity factors timed in the capacity section (default 1.0 1.25)",
    )
    p.add_argument(
        "--expert-matmul",
        default="auto",
        help="comma-separated expert matmul kernels to time as separate MoE rows: "
        "auto, loop, grouped_mm (default auto)",
    )
    p.add_argument("--no-sweep", action="store_true", help="only the default shapes")
    p.add_argument("--no-headline", action="store_true", help="skip the default-shapes section")
    p.add_argument("--no-memory", action="store_true", help="skip the peak memory section")
    p.add_argument("--no-fairscale", action="store_true")
    p.add_argument("--no-census", action="store_true", help="skip the census of collectives and host syncs")
    p.add_argument("--json", help="also write every measurement to this file")
    p.add_argument("--memory-probe", help=argparse.SUPPRESS)  # internal: one contender, fresh process
    args = p.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 7)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.token_sweep is None:
        args.token_sweep = [1024, 4096, 16384] if args.quick else [1024, 2048, 4096, 8192, 16384]
    if args.expert_sweep is None:
        args.expert_sweep = [4, 64] if args.quick else [4, 8, 16, 32, 64]
    args.matmuls = [m.strip() for m in args.expert_matmul.split(",") if m.strip()]
    return args


def check_device(args):
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(
            f"moe_layer.py: --device {args.device} asked for, but torch {torch.__version__} sees no "
            f"CUDA device (torch.cuda.is_available() is False); run on a GPU machine or use --device cpu"
        )
    if device.type not in ("cpu", "cuda"):
        sys.exit(f"moe_layer.py: unsupported --device {args.device}: use cpu or cuda")
    return device


def shape_of(args, **override) -> Shape:
    values = dict(d_model=args.d_model, hidden=args.hidden, experts=args.experts, k=args.top_k, tokens=args.tokens)
    values.update(override)
    return Shape(**values)


def ffn_flops(shape: Shape) -> float:
    """Expert FLOPs of one forward+backward: 2 GEMMs of 2*rows*d*H each, forward, twice that back."""
    return 3 * 2 * (2 * shape.tokens * shape.k * shape.d_model * shape.hidden)


def race(contenders, args, device):
    times = time_interleaved({c.name: c.step for c in contenders}, args.reps, args.warmup, device)
    return {name: (median(t), spread(t)) for name, t in times.items()}


def moe_contenders(shape, device, dtype, matmuls, **kw):
    return [build_contender("moe", shape, device, dtype, expert_matmul=m, **kw) for m in matmuls]


def headline(args, device, dtype, report):
    shape = shape_of(args)
    contenders = [build_contender("floor", shape, device, dtype)]
    contenders += moe_contenders(shape, device, dtype, args.matmuls)
    contenders.append(build_contender("dense", shape, device, dtype))
    skipped = fairscale_skip_reason(args, shape)
    if skipped is None:
        contenders.append(build_contender("fairscale", shape, device, dtype))
    if device.type == "cuda":
        from fairseq_moe_ext.moe.grouped_mm import select_expert_matmul

        moe = contenders[1]
        chosen = select_expert_matmul(moe.expert_matmul, moe.x, moe.module.experts.batched_fc1_w)
        print(f"expert matmul under 'auto' on this device and dtype: {chosen}")
    result = race(contenders, args, device)
    floor = result["floor"][0]
    print(
        f"\n## Default shapes: d_model {shape.d_model}, H {shape.hidden}, E {shape.experts}, "
        f"k {shape.k}, {shape.tokens} tokens, {args.dtype}"
    )
    print("floor = one dense FFN (d -> H -> d) on the k*N token copies; dense = d -> k*H -> d on N tokens")
    print(f"{'contender':<24}{'median ms':>11}{'spread':>9}{'x floor':>9}{'TFLOP/s':>9}")
    for name, (t, s) in result.items():
        print(f"{name:<24}{t * 1e3:>11.1f}{s * 100:>8.1f}%{t / floor:>9.3f}{ffn_flops(shape) / t / 1e12:>9.3f}")
    if skipped:
        print(f"fairscale: SKIPPED ({skipped})")
    else:
        moe_name = contenders[1].name
        print(f"fairscale MOELayer / our MoE: {result['fairscale'][0] / result[moe_name][0]:.2f}x")
    report["headline"] = {
        "shape": vars(shape),
        "seconds": {n: v[0] for n, v in result.items()},
        "fairscale_skipped": skipped,
    }
    del contenders


def fairscale_skip_reason(args, shape):
    if args.no_fairscale:
        return "--no-fairscale"
    reason = fits_fairscale(shape)
    if reason is None:
        error = import_fairscale()
        if error:
            reason = (
                f"cannot import fairscale ({error}); install it for the benchmark only with "
                f"`pip install --no-deps --target {sys.prefix}/benchmark-deps fairscale`"
            )
    return reason


def token_sweep(args, device, dtype, report):
    print("\n## Cost against tokens (dropless MoE and floor, each size timed side by side)")
    print(f"{'tokens':>8}{'moe ms':>10}{'floor ms':>10}{'x floor':>9}{'moe us/token':>14}")
    rows = []
    for n in args.token_sweep:
        shape = shape_of(args, tokens=n)
        contenders = [build_contender("floor", shape, device, dtype)] + moe_contenders(
            shape, device, dtype, args.matmuls[:1]
        )
        result = race(contenders, args, device)
        moe_t, floor_t = result[contenders[1].name][0], result["floor"][0]
        rows.append({"tokens": n, "moe": moe_t, "floor": floor_t})
        print(f"{n:>8}{moe_t * 1e3:>10.1f}{floor_t * 1e3:>10.1f}{moe_t / floor_t:>9.3f}{moe_t / n * 1e6:>14.1f}")
        del contenders
    first, last = rows[0], rows[-1]
    growth = (last["moe"] / first["moe"]) / (last["tokens"] / first["tokens"])
    print(
        f"per-token cost at {last['tokens']} over {first['tokens']} tokens: {growth:.2f} "
        f"(1.00 = linear; the floor's own: {(last['floor'] / first['floor']) / (last['tokens'] / first['tokens']):.2f})"
    )
    report["token_sweep"] = rows


def expert_sweep(args, device, dtype, report):
    print(f"\n## Cost against experts ({args.tokens} tokens; the floor does not depend on E)")
    print(f"{'experts':>8}{'moe ms':>10}{'floor ms':>10}{'x floor':>9}")
    rows = []
    for e in args.expert_sweep:
        if args.top_k > e:
            print(f"{e:>8}  skipped: k={args.top_k} > E")
            continue
        shape = shape_of(args, experts=e)
        contenders = [build_contender("floor", shape, device, dtype)] + moe_contenders(
            shape, device, dtype, args.matmuls[:1]
        )
        result = race(contenders, args, device)
        moe_t, floor_t = result[contenders[1].name][0], result["floor"][0]
        rows.append({"experts": e, "moe": moe_t, "floor": floor_t})
        print(f"{e:>8}{moe_t * 1e3:>10.1f}{floor_t * 1e3:>10.1f}{moe_t / floor_t:>9.3f}")
        del contenders
    report["expert_sweep"] = rows


def many_experts_section(args, device, dtype, report):
    """E small experts: the layer against the floor (one GEMM pair), against the same E GEMM pairs
    timed alone on the rows the router gives each expert, and against the dense FFN."""
    shape = shape_of(args, experts=args.many_experts)
    moe = moe_contenders(shape, device, dtype, args.matmuls)
    contenders = [
        build_contender("floor", shape, device, dtype),
        build_contender("expert floor", shape, device, dtype, counts=moe[0].expert_rows()),
    ]
    contenders += moe + [build_contender("dense", shape, device, dtype)]
    result = race(contenders, args, device)
    floor, expert_floor, dense = result["floor"][0], result["expert floor"][0], result["dense"][0]
    print(
        f"\n## Many experts: E {shape.experts}, {shape.tokens} tokens (expert floor = the {shape.experts} "
        f"experts' GEMM pairs alone, forward and backward, on the rows the router gives each)"
    )
    print(f"{'contender':<24}{'median ms':>11}{'spread':>9}{'x floor':>9}{'x expert floor':>16}{'x dense':>9}")
    for name, (t, s) in result.items():
        print(f"{name:<24}{t * 1e3:>11.1f}{s * 100:>8.1f}%{t / floor:>9.3f}{t / expert_floor:>16.3f}{t / dense:>9.3f}")
    report["many_experts"] = {"shape": vars(shape), "seconds": {n: v[0] for n, v in result.items()}}
    del contenders, moe


def skew_section(args, device, dtype, report):
    shape = shape_of(args)
    floor = build_contender("floor", shape, device, dtype)
    balanced = moe_contenders(shape, device, dtype, args.matmuls[:1])[0]
    skewed = moe_contenders(shape, device, dtype, args.matmuls[:1], skew=args.skew)[0]
    shares = {balanced.name: balanced.busiest_expert_share(), skewed.name: skewed.busiest_expert_share()}
    result = race([floor, balanced, skewed], args, device)
    print(f"\n## Skewed routing (dropless, {args.tokens} tokens): busiest expert's load over its fair share")
    print(f"{'contender':<24}{'busiest/share':>14}{'median ms':>11}{'x floor':>9}")
    for name, (t, _) in result.items():
        share = f"{shares[name]:.2f}" if name in shares else "-"
        print(f"{name:<24}{share:>14}{t * 1e3:>11.1f}{t / result['floor'][0]:>9.3f}")
    report["skew"] = {"busiest_share": shares, "seconds": {n: v[0] for n, v in result.items()}}


def capacity_section(args, device, dtype, report):
    shape = shape_of(args)
    contenders = [build_contender("floor", shape, device, dtype)] + moe_contenders(
        shape, device, dtype, args.matmuls[:1]
    )
    contenders += [
        moe_contenders(shape, device, dtype, args.matmuls[:1], capacity_factor=cf)[0]
        for cf in args.capacity_factors
        if cf
    ]
    if args.capacity_factors and args.capacity_factors[0]:  # many drops: the busiest expert's overflow
        contenders += moe_contenders(
            shape, device, dtype, args.matmuls[:1], capacity_factor=args.capacity_factors[0], skew=args.skew
        )
    skipped = fairscale_skip_reason(args, shape)
    if skipped is None:
        contenders.append(build_contender("fairscale", shape, device, dtype))
    dropped = {c.name: c.dropped_fraction() for c in contenders if hasattr(c, "dropped_fraction")}
    result = race(contenders, args, device)
    floor = result["floor"][0]
    print(
        f"\n## Capacity path ({args.tokens} tokens; dropped slots do no expert work, so a row may"
        f" cost less than the floor)"
    )
    print(f"{'contender':<24}{'dropped':>9}{'median ms':>11}{'x floor':>9}")
    for name, (t, _) in result.items():
        share = f"{dropped[name] * 100:.1f}%" if name in dropped else "-"
        print(f"{name:<24}{share:>9}{t * 1e3:>11.1f}{t / floor:>9.3f}")
    if skipped:
        print(f"fairscale: SKIPPED ({skipped})")
    else:
        same_capacity = [c.name for c in contenders if getattr(c, "capacity_factor", None) == 1.0]
        if same_capacity:
            print(
                f"fairscale MOELayer / our MoE at the same capacity (cf=1, 2N/E slots): "
                f"{result['fairscale'][0] / result[same_capacity[0]][0]:.2f}x"
            )
    report["capacity"] = {
        "dropped": dropped,
        "seconds": {n: v[0] for n, v in result.items()},
        "fairscale_skipped": skipped,
    }
    del contenders


def main(argv=None):
    args = parse_args(argv)
    device = check_device(args)
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    if args.memory_probe:
        return memory_probe(args, device, dtype, shape_of)
    print(f"# MoE layer benchmark, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")
    print(machine_summary(device))
    report = {"args": {k: v for k, v in vars(args).items()}, "machine": machine_summary(device)}
    if not args.no_census:
        census_section(report)
    if not args.no_headline:
        headline(args, device, dtype, report)
    if args.many_experts:
        many_experts_section(args, device, dtype, report)
    if not args.no_sweep:
        token_sweep(args, device, dtype, report)
        expert_sweep(args, device, dtype, report)
        skew_section(args, device, dtype, report)
        capacity_section(args, device, dtype, report)
    if not args.no_memory:
        with_fairscale = fairscale_skip_reason(args, shape_of(args)) is None
        memory_section(args, device, report, os.path.abspath(__file__), with_fairscale)
    print(
        f"\nload average at the end: {os.getloadavg()[0]:.2f} (above {os.cpu_count()} means other work shared the cores)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
