#!/usr/bin/env python
"""One-shot step 4: the MoE layer with process groups on one GPU.

* one rank over NCCL: the layer (bf16, the expert matmul ``auto`` picks) with ``group`` = a
  one-rank NCCL group against ``group=None``: output and every gradient bit-identical, dropless,
  with capacity and with padding;
* two ranks sharing the GPU over ``cuda:gloo`` (an emulation: NCCL refuses two ranks on one
  device, and a ``cuda:gloo`` group fails on CPU tensors exactly as NCCL does), fp32, against one
  process holding every expert: expert parallelism (dropless, and capacity with drops), replicas
  (every rank holds all experts, statistics over both), a rank whose batch is all padding, and
  lock-step inference with uneven numbers of rounds per rank. Outputs within 1e-5 and gradients
  within 1e-4 (max-abs relative), losses within 1e-5. With two GPUs or more: NCCL on two GPUs instead;
* the census on the device (recipes/layer_census.py, what tests/core/test_collective_census.py counts on
  CPU threads): collectives and host syncs of one layer call per mode, each rank's against the table the
  CPU holds; and the time in each collective of one bf16 training call against the call's (the device
  synchronised around each collective), so that a first draw tells how much of a step is communication.
On the CPU dry run the same runs over gloo on CPU tensors (labelled so).
"""

import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig  # noqa: E402
from fairseq_moe_ext.moe.lockstep import LockStep  # noqa: E402
from report import DRY_RUN, ROOT, device, emit, left, rel_err, run_guarded, sized, verdict

sys.path.insert(0, str(ROOT / "recipes"))
from layer_census import EXPECTED, Counted, census_of_modes, census_table, timed_call, timed_lines  # noqa: E402

D, H, E = 64, 128, 8
SIZES = [13, 29]  # tokens per rank: uneven
# Per rank, (stack, tokens) calls in its own order (rank 1 runs more decoder steps than rank 0).
# fmt: off
PLANS = [[(0, 5), (1, 5), (1, 4), (1, 1), (0, 2), (1, 2)],
         [(0, 7), (1, 7), (0, 3), (1, 3), (1, 3), (1, 3), (1, 2), (1, 1)]]
# fmt: on
LABEL = (
    "dry run: 2 gloo ranks on CPU"
    if DRY_RUN
    else "2 GPUs over NCCL"
    if torch.cuda.device_count() >= 2
    else "emulation: 2 ranks share one GPU over cuda:gloo"
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layer(group, cf=0.0, statistics_group=None, seed=5, d=D, h=H):
    torch.manual_seed(0)  # the router (shared) from a common seed; experts are seeded by global id
    return MoELayer(
        MoELayerConfig(d, h, E, capacity_factor=cf), seed=seed, group=group, statistics_group=statistics_group
    )


def batch(n_total, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_total, D, generator=g), torch.randn(n_total, D, generator=g)


def objective(moe, x, upstream, weight, mask=None):
    x = x.detach().clone().requires_grad_()
    y, aux = moe.forward_with_aux(x, mask)
    ((y * upstream).sum() + weight * (aux.balance_loss + 0.1 * aux.z_loss)).backward()
    return {
        "y": y.detach().cpu(),
        "x": x.grad.cpu(),
        "balance": float(aux.balance_loss.detach()),
        "z": float(aux.z_loss.detach()),
        "dropped": float(aux.stats["dropped_slots"]),
        "grads": {n: p.grad.detach().cpu() for n, p in moe.named_parameters() if p.grad is not None},
    }


# ---------------------------------------------------------------- two ranks (workers)


def worker(rank, world, port, backend, out_dir):
    dev = torch.device("cpu") if backend == "gloo" else torch.device("cuda", rank if backend == "nccl" else 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    x, upstream = batch(sum(SIZES))
    rows = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    share = SIZES[rank] / sum(SIZES)
    for name, cf in (("expert_parallel", 0.0), ("expert_parallel_capacity", 0.5)):
        moe = layer(dist.group.WORLD, cf).to(dev)
        results[name] = objective(moe, x[rows].to(dev), upstream[rows].to(dev), share)
    # Replicas: each rank its own one-rank expert group, statistics over both.
    singles = [dist.new_group([r]) for r in range(world)]
    moe = layer(singles[rank], 0.5, statistics_group=dist.group.WORLD).to(dev)
    result = objective(moe, x[rows].to(dev), upstream[rows].to(dev), share)
    for n, g in result["grads"].items():  # what training does with replicas' expert gradients
        if not n.startswith("experts."):
            continue
        summed = g.to(dev)
        dist.all_reduce(summed)
        result["grads"][n] = summed.cpu()
    results["replicas"] = result
    # A rank whose batch is all padding (fairseq's dummy batch).
    moe = layer(dist.group.WORLD, 0.5).to(dev)
    pad = (
        torch.zeros(SIZES[rank], dtype=torch.bool, device=dev)
        if rank == 0
        else torch.ones(6, dtype=torch.bool, device=dev)
    )
    xs = x[rows] if rank == 0 else torch.randn(6, D)
    results["pad_only_rank"] = objective(moe, xs.to(dev), torch.ones(xs.shape).to(dev), 1.0, pad)
    # Lock-step inference, uneven rounds.
    stacks = lockstep_stacks(dist.group.WORLD, dev)
    lockstep, outputs = LockStep(stacks, dist.group.WORLD), []
    with torch.no_grad(), lockstep.session():
        for call, (stack, _) in enumerate(PLANS[rank]):
            lockstep.before(stack)
            outputs.append(run_stack(stacks[stack], lockstep_input(rank, call).to(dev)).cpu())
    results["lockstep"] = outputs
    counted = census_of_modes(dist.group.WORLD, rank, dev)  # plain tuples: torch.load reads weights only
    results["census"] = {
        mode: (c.forward, c.backward, c.forward_syncs, c.backward_syncs) for mode, c in counted.items()
    }
    d, h, rows = sized((1024, 4096, 8192), (64, 128, 256))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    results["timed"] = timed_call(dist.group.WORLD, rank, dev, d=d, h=h, rows=rows, dtype=dtype)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def lockstep_stacks(group, dev):
    torch.manual_seed(0)
    layers = [MoELayer(MoELayerConfig(D, H, E), seed=10 + i, group=group).to(dev).eval() for i in range(3)]
    return [layers[:1], layers[1:]]


def run_stack(stack, x):
    for moe in stack:
        x = x + moe(x)
    return x


def lockstep_input(rank, call):
    return torch.randn(PLANS[rank][call][1], D, generator=torch.Generator().manual_seed(100 * rank + call))


def two_ranks(dev):
    backend = "gloo" if dev.type == "cpu" else "nccl" if torch.cuda.device_count() >= 2 else "cuda:gloo"
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            worker, args=(2, free_port(), backend, out_dir), nprocs=2, join=False, start_method="spawn"
        )
        limit = time.time() + max(left() - 15, 10)
        while not context.join(timeout=1):
            if time.time() > limit:
                for process in context.processes:
                    process.kill()
                return emit(
                    "FAIL", "groups_two_ranks", f"({LABEL}) the workers were still running at the deadline: a hang"
                )
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    compare_two_ranks(ranks, dev)


def close(name, got, want, bound):
    err = rel_err(got, want)
    return err <= bound, f"{name} {err:.1e}"


def compare_two_ranks(ranks, dev):
    x, upstream = batch(sum(SIZES))
    for name, cf in (("expert_parallel", 0.0), ("expert_parallel_capacity", 0.5), ("replicas", 0.5)):
        want = objective(layer(None, cf).to(dev), x.to(dev), upstream.to(dev), 1.0)
        got = [r[name] for r in ranks]
        checks = [close("y", torch.cat([g["y"] for g in got]), want["y"], 1e-5)]
        for n, g in want["grads"].items():
            if n.startswith("experts."):
                mine = got[0]["grads"][n] if name == "replicas" else torch.cat([r["grads"][n] for r in got])
            else:  # shared: data parallelism sums them
                mine = got[0]["grads"][n] + got[1]["grads"][n]
            checks.append(close(n, mine, g, 1e-4))
        losses = max(abs(r[k] - want[k]) / abs(want[k]) for r in got for k in ("balance", "z"))
        checks.append((losses <= 1e-5, f"losses {losses:.1e}"))
        dropped = sum(r["dropped"] for r in got)
        ok = all(c[0] for c in checks) and dropped == want["dropped"]
        worst = [c[1] for c in checks if not c[0]] or [max((c[1] for c in checks), key=lambda s: float(s.split()[-1]))]
        verdict(
            f"groups_two_ranks[{name}]",
            ok,
            f"({LABEL}) vs one process holding every expert, tokens {SIZES}: "
            f"dropped {dropped:.0f}/{want['dropped']:.0f}; {'worst' if ok else 'off'}: {', '.join(worst)}",
        )
    reference = objective(layer(None, 0.5).to(dev), x[: SIZES[0]].to(dev), torch.ones(SIZES[0], D).to(dev), 1.0)
    pad_rank = ranks[1]["pad_only_rank"]
    ok_y, said = close("rank 0 y", ranks[0]["pad_only_rank"]["y"], reference["y"], 1e-5)
    verdict(
        "groups_two_ranks[pad_only_rank]",
        ok_y and not pad_rank["y"].any(),
        f"({LABEL}) rank 1 all padding: rank 0 equals one process on its tokens ({said}); rank 1's output "
        f"{'is all zeros' if not pad_rank['y'].any() else 'is NOT zero'}; forward and backward returned",
    )
    stacks = lockstep_stacks(None, dev)
    errors = []
    for rank in range(2):
        for call, (stack, _) in enumerate(PLANS[rank]):
            with torch.no_grad():
                want = run_stack(stacks[stack], lockstep_input(rank, call).to(dev)).cpu()
            errors.append(rel_err(ranks[rank]["lockstep"][call], want))
    census_verdict(ranks)
    verdict(
        "groups_two_ranks[lockstep_uneven]",
        max(errors) <= 1e-5,
        f"({LABEL}) {len(PLANS[0])} and {len(PLANS[1])} MoE calls per rank: every output vs one process "
        f"within {max(errors):.1e} (bound 1e-5)",
    )


def census_verdict(ranks):
    found = [r["census"] for r in ranks]
    off = [f"rank {rank} {mode}: {got} (want {EXPECTED[mode]})" for rank, counts in enumerate(found)
           for mode, got in counts.items() if got != EXPECTED[mode]]  # fmt: skip
    verdict(
        "groups_two_ranks[census]",
        not off,
        f"({LABEL}) collectives fwd/bwd, host syncs fwd/bwd per layer call, by mode: "
        + ("as on CPU: " + "; ".join(f"{m} {c}" for m, c in found[0].items()) if not off else "; ".join(off)),
    )
    seconds, collectives = ranks[0]["timed"]
    spent = sum(c[1] for c in collectives)
    emit(
        "INFO",
        "groups_two_ranks[collective_time]",
        f"({LABEL}) one training call: {spent * 1e3:.2f} ms in {len(collectives)} collectives of {seconds * 1e3:.2f} ms "
        f"({spent / seconds:.0%}); each: " + ", ".join(f"{op} {t * 1e3:.2f} ms" for op, t, _ in collectives),
        seconds=seconds,
        collectives=collectives,
    )
    print(census_table({mode: Counted(*counts, "") for mode, counts in found[0].items()}))
    print(timed_lines(ranks[0]["timed"]))


# ---------------------------------------------------------------- one rank over NCCL


def one_rank_group(dev):
    backend = "nccl" if dev.type == "cuda" else "gloo"
    label = "NCCL" if dev.type == "cuda" else "dry run: gloo on CPU stands in for NCCL"
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        device_id=dev if dev.type == "cuda" else None,
    )
    try:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        g = torch.Generator().manual_seed(4)
        x = torch.randn(4, 256, 256, generator=g)
        mask = torch.zeros(4, 256, dtype=torch.bool)
        mask[1, 200:] = mask[3, 100:] = True
        for case, cf, m in (("dropless", 0.0, None), ("capacity", 0.5, None), ("padding", 0.5, mask)):
            runs = []
            for group in (None, dist.group.WORLD):
                moe = layer(group, cf, d=256, h=512).to(dev, dtype)
                runs.append(
                    objective(
                        moe, x.to(dev, dtype), torch.ones(x.shape).to(dev, dtype), 1.0, None if m is None else m.to(dev)
                    )
                )
            same = [k for k in ("y", "x") if torch.equal(runs[0][k], runs[1][k])]
            same += [n for n in runs[0]["grads"] if torch.equal(runs[0]["grads"][n], runs[1]["grads"][n])]
            total = 2 + len(runs[0]["grads"])
            losses = runs[0]["balance"] == runs[1]["balance"] and runs[0]["z"] == runs[1]["z"]
            verdict(
                f"groups_one_rank[{case}]",
                len(same) == total and losses,
                f"({label}) {str(dtype)[6:]} layer with a one-rank group vs group=None: {len(same)}/{total} tensors "
                f"bit-identical, losses {'equal' if losses else 'DIFFER'}",
            )
    finally:
        dist.destroy_process_group()


def main():
    dev = device()
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    run_guarded("groups_one_rank", one_rank_group, dev)
    if left() < 20:
        return emit("SKIP", "groups_two_ranks", f"(deadline) {left():.0f}s left")
    run_guarded("groups_two_ranks", two_ranks, dev)


if __name__ == "__main__":
    main()
