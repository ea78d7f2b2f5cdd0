"""Section (5) of moe_layer.py: the peak memory of one forward+backward step of each contender, each measured in
a fresh process (``moe_layer.py --memory-probe NAME``) so that one contender's caches never count against the
next."""

import json

from contenders import build_contender, import_fairscale
from measure import memory_in_subprocess, peak_step_memory

FORWARDED = ("device", "dtype", "threads", "d_model", "hidden", "experts", "top_k", "tokens", "skew")


def memory_section(args, device, report, script, with_fairscale):
    """Run ``script --memory-probe NAME`` for every contender and print each peak against the floor's."""
    names = ["floor"] + [f"moe:{m}" for m in args.matmuls] + ["dense"]
    if with_fairscale:
        names.append("fairscale")
    names.append(f"moe:{args.matmuls[0]}:skew")
    print(
        f"\n## Peak memory of one forward+backward step (growth over the built model and inputs; "
        f"{'GPU allocated' if device.type == 'cuda' else 'resident set, fresh process per row'})"
    )
    print(f"{'contender':<24}{'peak MiB':>10}{'x floor':>9}")
    common = [item for name in FORWARDED for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    rows = {}
    for name in names:
        probe = memory_in_subprocess(script, common + ["--memory-probe", name])
        rows[name] = probe
        if "error" in probe:
            print(f"{name:<24}  failed: {probe['error']}")
            continue
        floor = rows.get("floor", {}).get("bytes")
        ratio = f"{probe['bytes'] / floor:>9.2f}" if floor else f"{'-':>9}"
        print(f"{probe['name']:<24}{probe['bytes'] / 2**20:>10.0f}{ratio}")
    report["memory"] = rows


def memory_probe(args, device, dtype, shape_of):
    """The child's side: build one contender, warm the libraries up, print its step's peak as JSON."""
    kind, _, rest = args.memory_probe.partition(":")
    matmul, _, skew = rest.partition(":")
    kw = {}
    if kind == "moe":
        kw = {"expert_matmul": matmul or "auto", "skew": args.skew if skew else None}
    if kind == "fairscale":
        import_fairscale()
    # Warm libraries up (thread pools, BLAS buffers, process group) on a tiny instance first, so
    # the measured growth is the step's own.
    tiny = build_contender(kind, shape_of(args, tokens=args.experts * 4), device, dtype, **kw)
    tiny.step()
    del tiny
    contender = build_contender(kind, shape_of(args), device, dtype, **kw)
    print(json.dumps({"name": contender.name, "bytes": peak_step_memory(contender.step, device)}))
