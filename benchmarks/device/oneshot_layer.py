#!/usr/bin/env python
"""One-shot step 2, the MoE layer without fairseq:

* reference: for every router (top, cosine, sigmoid) and mode (dropless; capacity factor 0.5;
  padding; batch-prioritised under capacity; a shared expert with a balance bias), the layer in fp32
  on the device against fairseq_moe_ext/moe/reference.py (one token at a time, from the definitions) in fp64
  on the CPU: output, input gradient and every parameter gradient within 2e-5 / 1e-4 (max-abs
  relative). Inputs are redrawn until no token sits within 1e-4 of a routing tie, so both sides
  route the same way;
* precision matrix at fixed fp32 weights: autocast fp16/bf16 and pure fp16/bf16 against fp32,
  relative (Frobenius) error of y, dx and the parameter gradients, top-1 agreement, balance and
  z-loss; the bounds are in PRECISION_BOUNDS;
* bitwise repeat: the same forward+backward twice gives the same bits (bf16 on CUDA: auto and loop);
* host syncs (CUDA): torch's sync debug mode counts the synchronising calls of one forward and one
  backward; docs/performance.md promises one per forward and none in backward.
"""

import copy
import warnings

import torch

from fairseq_moe_ext.moe import MoELayer, MoELayerConfig
from fairseq_moe_ext.moe.reference import reference_logits, reference_moe
from report import DRY_RUN, device, emit, out_of_time, rel_err, run_guarded, sized, skip_cuda, verdict

ROUTERS = ("top", "cosine", "sigmoid")
# fmt: off
MODES = {
    "dropless": {},
    "capacity": {"capacity_factor": 0.5},
    "padding": {},
    "batch_prioritized": {"capacity_factor": 0.5, "batch_prioritized": True},
    "shared_bias": {"shared_expert_count": 1, "balance_bias_rate": 1e-3},
}
# fmt: on
REF_BOUNDS = {"y": 2e-5, "grad": 1e-4}
# (name, how it runs, bound on y, on every gradient, least top-1 agreement, balance/z-loss rel diff);
# errors are relative Frobenius norms against fp32. Gradients through ReLU's derivative (dx, fc1) carry
# about 30 (fp16) / 10 (bf16) unit roundoffs where a hidden unit sits near 0 (seen on CPU at d 64-256);
# pure low precision also feeds the router rounded tokens, so a few top-1 choices flip. Under
# autocast the router runs in fp32 on the same input: its choices and losses must not move at all.
# fmt: off
PRECISION_BOUNDS = [
    ("autocast_fp16", "autocast", torch.float16, 2e-3, 5e-2, 1.0, 1e-6),
    ("autocast_bf16", "autocast", torch.bfloat16, 1.5e-2, 1e-1, 1.0, 1e-6),
    ("pure_fp16", "pure", torch.float16, 1e-2, 5e-2, 0.99, 5e-3),
    ("pure_bf16", "pure", torch.bfloat16, 8e-2, 1.5e-1, 0.98, 2e-2),
]
# fmt: on


def build(router, mode, d, h, e, seed):
    torch.manual_seed(seed)
    kw = dict(MODES[mode])
    layer = MoELayer(MoELayerConfig.of(d, h, e, k=2, router_type=router, **kw), seed=seed)
    if layer.router.balance_bias is not None:
        layer.router.balance_bias.bias.copy_(torch.randn(e) * 0.05)
    return layer


def near_tie(layer, x, mask):
    """Whether any real token's k-th and (k+1)-th selection scores (or, under batch priority, two
    tokens' priorities) are within 1e-4: there the device and the reference may round differently."""
    router, k = layer.router, layer.k
    flat = x.reshape(-1, x.shape[-1]).double()
    with torch.no_grad():
        logits = torch.stack([reference_logits(router, t) for t in flat]).double()
        scores = torch.sigmoid(logits) if router.router_type == "sigmoid" else torch.softmax(logits, -1)
        if router.balance_bias is not None:
            logits = scores + router.balance_bias.bias.double()
        top = logits.topk(k + 1, dim=-1).values
        real = torch.ones(flat.shape[0], dtype=torch.bool) if mask is None else ~mask.reshape(-1)
        gaps = (top[:, :-1] - top[:, 1:])[real]
        if gaps.min() < 1e-4:
            return True
        if router.batch_prioritized:
            first = scores.gather(1, logits.topk(k, dim=-1).indices)
            first = (
                (
                    first / first.sum(-1, keepdim=True)
                    if router.normalize_gates or router.router_type == "sigmoid"
                    else first
                )[:, 0][real]
                .sort()
                .values
            )
            return bool((first[1:] - first[:-1]).min() < 1e-4)
    return False


def reference_case(router, mode, dev, sizes):
    d, h, e, n = sizes
    for seed in range(8):
        layer = build(router, mode, d, h, e, seed)
        g = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(2, n // 2, d, generator=g)
        mask = None
        if mode == "padding":
            mask = torch.zeros(2, n // 2, dtype=torch.bool)
            mask[0, -n // 8 :] = True
            mask[1, -n // 5 :] = True
        if not near_tie(layer, x, mask):
            break
    upstream = torch.randn(x.shape, generator=g)
    # The device, fp32 (full-precision matmuls: TF32 off).
    on_device = copy.deepcopy(layer).to(dev)
    xd = x.detach().clone().to(dev).requires_grad_()
    y, aux = on_device.forward_with_aux(xd, None if mask is None else mask.to(dev))
    (y * upstream.to(dev)).sum().backward()
    # The reference, fp64 on the CPU.
    reference = copy.deepcopy(layer).double()
    xr = x.detach().double().requires_grad_()
    y_ref, _ = reference_moe(reference, xr, mask)
    (y_ref * upstream.double()).sum().backward()
    errors = {"y": rel_err(y, y_ref), "dx": rel_err(xd.grad, xr.grad)}
    ref_grads = dict(reference.named_parameters())
    for name, p in on_device.named_parameters():
        if p.grad is not None or ref_grads[name].grad is not None:
            want = ref_grads[name].grad if ref_grads[name].grad is not None else torch.zeros_like(ref_grads[name])
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            errors[name] = rel_err(got, want)
    worst_grad = max(v for k, v in errors.items() if k != "y")
    ok = errors["y"] <= REF_BOUNDS["y"] and worst_grad <= REF_BOUNDS["grad"]
    worst = max((k for k in errors if k != "y"), key=errors.get)
    verdict(
        f"layer_reference[{router},{mode}]",
        ok,
        f"fp32 {dev.type} vs fp64 CPU reference: y {errors['y']:.1e} (bound {REF_BOUNDS['y']:.0e}), worst gradient "
        f"{worst} {worst_grad:.1e} (bound {REF_BOUNDS['grad']:.0e}), {n} tokens, {int(aux.stats['dropped_slots'])} slots "
        f"dropped, input seed {seed}",
        errors=errors,
    )


def run_variant(layer, x, upstream, how, dtype):
    """(y, grads, top-1 expert per token, balance loss, z-loss) of one forward+backward."""
    model = copy.deepcopy(layer)
    if how == "pure":
        model = model.to(dtype)
        x = x.to(dtype)
    x = x.detach().requires_grad_()
    with torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=how == "autocast"):
        y, aux = model.forward_with_aux(x)
        top1 = model.router(x.reshape(-1, x.shape[-1])).expert_index[:, 0]
    (y.float() * upstream).sum().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    grads["x"] = x.grad.float()
    return y.float(), grads, top1, float(aux.balance_loss.detach()), float(aux.z_loss.detach())


def precision_matrix(dev):
    d, h, e, n = sized((1024, 4096, 8, 4096), (64, 128, 8, 256))
    layer = build("top", "dropless", d, h, e, seed=3).to(dev)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, d, generator=g).to(dev)
    upstream = torch.randn(n, d, generator=g).to(dev)
    y32, grads32, top32, bal32, z32 = run_variant(layer, x, upstream, "fp32", None)

    def frob(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    for name, how, dtype, y_bound, grad_bound, least_agree, loss_bound in PRECISION_BOUNDS:
        if out_of_time(f"layer_precision[{name}]", 5):
            continue
        y, grads, top1, bal, z = run_variant(layer, x, upstream, how, dtype)
        errors = {"y": frob(y, y32), **{k: frob(v, grads32[k]) for k, v in grads.items()}}
        agree = (top1 == top32).float().mean().item()
        loss_diff = max(abs(bal - bal32) / abs(bal32), abs(z - z32) / abs(z32))
        worst = max((k for k in errors if k != "y"), key=errors.get)
        ok = errors["y"] <= y_bound and errors[worst] <= grad_bound and agree >= least_agree and loss_diff <= loss_bound
        verdict(
            f"layer_precision[{name}]",
            ok,
            f"vs fp32 at d={d} H={h} E={e} {n} tokens: y {errors['y']:.1e} (bound {y_bound:.0e}), worst gradient "
            f"{worst} {errors[worst]:.1e} (bound {grad_bound:.0e}); top-1 agreement {agree:.4f} (least {least_agree}); "
            f"balance/z-loss rel diff {loss_diff:.1e} (bound {loss_bound:.0e})",
            errors=errors,
            top1_agreement=agree,
            loss_diff=loss_diff,
        )


def bitwise_repeat(dev):
    d, h, e, n = sized((1024, 4096, 8, 8192), (64, 128, 8, 256))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for matmul in ("auto", "loop") if dev.type == "cuda" else ("loop",):
        layer = build("top", "capacity", d, h, e, seed=5)
        layer.experts.matmul = matmul
        layer = layer.to(dev, dtype)
        g = torch.Generator().manual_seed(9)
        x = torch.randn(n, d, generator=g).to(dev, dtype)
        runs = []
        for _ in range(2):
            layer.zero_grad()
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.float().pow(2).sum().backward()
            runs.append([y.detach(), xi.grad] + [p.grad for p in layer.parameters() if p.grad is not None])
        same = all(torch.equal(a, b) for a, b in zip(*runs))
        verdict(
            f"layer_bitwise_repeat[{dtype_name(dtype)},{matmul}]",
            same,
            f"forward+backward twice at d={d} H={h} E={e} {n} tokens, capacity 0.5: "
            f"{'every tensor bit-identical' if same else 'tensors DIFFER'} ({len(runs[0])} tensors)",
        )


def dtype_name(dtype):
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def host_syncs(dev):
    if dev.type != "cuda":
        return skip_cuda("layer_host_syncs", "torch's sync debug mode watches CUDA only")
    d, h, e, n = 1024, 4096, 8, 4096
    cases = {
        "dropless,auto": ("dropless", "auto"),
        "dropless,loop": ("dropless", "loop"),
        "capacity,auto": ("capacity", "auto"),
        "shared_bias,auto": ("shared_bias", "auto"),
    }
    for name, (mode, matmul) in cases.items():
        layer = build("top", mode, d, h, e, seed=1)
        layer.experts.matmul = matmul
        layer = layer.to(dev, torch.bfloat16)
        x = torch.randn(n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        layer(x).float().sum().backward()  # warm-up: allocator, kernels, the group check
        torch.cuda.synchronize()
        counts = []
        for phase in ("forward", "backward"):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    if phase == "forward":
                        y = layer(x)
                    else:
                        y.float().sum().backward()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counts.append(sum("synchroniz" in str(w.message) for w in seen))
        verdict(
            f"layer_host_syncs[{name}]",
            counts[0] <= 1 and counts[1] == 0,
            f"bf16, {n} tokens: {counts[0]} synchronising call(s) in forward (promise: 1), {counts[1]} in backward "
            f"(promise: 0)",
            forward=counts[0],
            backward=counts[1],
        )


def main():
    dev = device()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sizes = sized((128, 256, 8, 96), (32, 64, 8, 24))
    for router in ROUTERS:
        for mode in MODES:
            if out_of_time(f"layer_reference[{router},{mode}]", 3):
                continue
            run_guarded(f"layer_reference[{router},{mode}]", reference_case, router, mode, dev, sizes)
    for name, step in (
        ("layer_precision", precision_matrix),
        ("layer_bitwise_repeat", bitwise_repeat),
        ("layer_host_syncs", host_syncs),
    ):
        if not out_of_time(name, 8):
            run_guarded(name, step, dev)
    if DRY_RUN:
        emit("INFO", "layer_sizes", "dry run: tiny sizes on CPU; the GPU run uses d=128/1024, H=256/4096")


if __name__ == "__main__":
    main()
