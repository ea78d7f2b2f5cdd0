"""The memory expert pruning saves: a set's weights (shared parameters, and each MoE layer's experts) at
every keep fraction, and the smallest common GPU that holds them.

Counted from the set's own tensors (each rank file read with mmap: shapes only, nothing copied), or
with ``--nllb-200-moe`` from the released NLLB-200 MoE's shapes (transformer_24_24_big: width 2048, FFN
8192, 24 + 24 layers, every 4th an MoE layer of 128 experts, a 256,206-row shared embedding; the
54.5B parameters of its README).

  python recipes/pruned_memory.py ckpt/checkpoint_best.pt [--fractions 1 0.5 0.25 0.2] [--bytes 2]
  python recipes/pruned_memory.py --nllb-200-moe
"""

import argparse
import os
import sys

# (name, memory in GB of 10^9 bytes) of common GPUs, smallest first; a GPU holds the weights when they
# leave it HEADROOM of its memory for activations, the beam's state and the CUDA context
HEADROOM = 0.1
GPUS = [
    ("24 GB (RTX 4090, A10)", 24),
    ("32 GB (V100)", 32),
    ("40 GB (A100 40GB)", 40),
    ("48 GB (L40S, A6000)", 48),
    ("80 GB (A100, H100)", 80),
    ("141 GB (H200)", 141),
]


def from_set(path: str):
    """(shared parameters, {MoE layer: (experts, parameters per expert)}) of the set or file ``path``."""
    import torch

    from fairseq_moe_ext import checkpoint as moe_ckpt

    resolved = moe_ckpt.resolve(path, fallback=False)
    if resolved is None:
        sys.exit(f"no checkpoint named {path}")
    if resolved.kind == "set":
        manifest = moe_ckpt.read_manifest(resolved.path)
        files = [os.path.join(os.path.dirname(resolved.path), f["name"]) for f in manifest["files"]]
    else:
        files = [resolved.path]
    shared, experts = 0, {}
    for rank, name in enumerate(files):
        with torch.serialization.safe_globals(moe_ckpt.CHECKPOINT_SAFE_GLOBALS):
            state = torch.load(name, map_location="cpu", weights_only=True, mmap=True)
        keys = set(state["moe"]["expert_keys"])
        for key, tensor in state["model"].items():
            if key in keys:
                layer = key.rsplit(".experts.", 1)[0]
                held, per = experts.get(layer, (0, 0))
                count = tensor.shape[0]
                experts[layer] = (held + (count if key.endswith("fc1_w") else 0), per + tensor[0].numel() * count)
            elif rank == 0:
                shared += tensor.numel()
    return shared, {layer: (held, total // held) for layer, (held, total) in experts.items()}


def nllb_200_moe():
    """The released model's shapes (its parameters as fairseq's transformer_24_24_big with MoE holds them)."""
    d, ffn, vocab, experts, layers, every = 2048, 8192, 256206, 128, 24, 4
    attention = 4 * (d * d + d)
    expert = d * ffn + ffn + ffn * d + d
    shared = vocab * d + 2 * 2 * d  # one embedding for encoder, decoder and output; the final layer norms
    for side, attentions in (("encoder", 1), ("decoder", 2)):
        for i in range(layers):
            moe = i % every == every - 1
            shared += attentions * attention + (attentions + 1) * 2 * d + (d * experts if moe else expert)
    moe_layers = {
        f"{side}.layers.{i}.fc1": (experts, expert)
        for side in ("encoder", "decoder")
        for i in range(every - 1, layers, every)
    }
    return shared, moe_layers


def table(shared: int, layers: dict, fractions, width: int) -> str:
    total_experts = sum(n * per for n, per in layers.values())
    lines = [
        f"shared parameters {count(shared)}, experts {count(total_experts)} in {len(layers)} MoE layers of "
        f"{max(n for n, _ in layers.values())} experts; weights at {width} bytes per parameter",
        "",
        f"| keep | experts per layer | parameters | weights | smallest GPU that holds the weights with "
        f"{HEADROOM:.0%} to spare |",
        "| --- | --- | --- | --- | --- |",
    ]
    for fraction in fractions:
        kept = {layer: max(1, round(fraction * n)) for layer, (n, _) in layers.items()}
        params = shared + sum(kept[layer] * per for layer, (_, per) in layers.items())
        size = params * width / 1e9
        gpu = next((name for name, gb in GPUS if size <= (1 - HEADROOM) * gb), "none: shard the experts over GPUs")
        lines.append(f"| {fraction:g} | {sorted(set(kept.values()))[0]} | {count(params)} | {size:.3g} GB | {gpu} |")
    return "\n".join(lines)


def count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.3g}M"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="a set or file (its tensors' shapes are read)")
    parser.add_argument("--nllb-200-moe", action="store_true", help="the released NLLB-200 MoE's shapes instead")
    parser.add_argument("--fractions", type=float, nargs="+", default=[1, 0.5, 0.25, 0.2, 0.125])
    parser.add_argument("--bytes", type=int, default=2, help="bytes per parameter (2: bf16 / fp16, 4: fp32)")
    args = parser.parse_args(argv)
    if args.nllb_200_moe == bool(args.checkpoint):
        parser.error("give a checkpoint or --nllb-200-moe (one of them)")
    shared, layers = nllb_200_moe() if args.nllb_200_moe else from_set(args.checkpoint)
    print(table(shared, layers, args.fractions, args.bytes))


if __name__ == "__main__":
    main()
