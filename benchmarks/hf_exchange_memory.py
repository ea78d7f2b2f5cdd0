"""Peak memory of ``export-hf`` and ``import-hf`` on a synthetic 16-rank set.

    python benchmarks/hf_exchange_memory.py [--ranks 16] [--layers 4] [--dim 256] [--hidden 2048] [--shard-mb 16]
                                            [--cast float16]

Writes a set of this project's format (16 rank files, one expert each in every MoE layer, fp32, rank 0
also holding the shared parameters), exports it with ``--max-shard-size`` of ``--shard-mb`` MB, then
imports the export into W = 1, 4 and 16 output files, each step in a fresh process, and prints the
process's peak resident memory (VmHWM, reset first) above what it held before (torch and the package imported), beside
the bound each should stay near: export, one rank file (rank 0, the largest) plus one output shard;
import, one output file (rank 0's holds the shared parameters too). W = 1 writes every expert into
one file, so its peak is the whole model by construction. ``--cast`` also exports with ``--dtype`` (each tensor
cast as it is streamed): the same bound (a cast copy lives only in the pending shard), never the whole model.
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch

MB = 1 << 20


def write_synthetic_set(name: str, ranks: int, layers: int, dim: int, hidden: int, vocab: int = 8000) -> None:
    from fairseq_moe_ext.checkpoint import moe_metadata, save_set

    options = argparse.Namespace(
        arch="moe_transformer",
        encoder_layers=layers // 2,
        decoder_layers=layers // 2,
        encoder_embed_dim=dim,
        decoder_embed_dim=dim,
        encoder_ffn_embed_dim=hidden,
        decoder_ffn_embed_dim=hidden,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        share_all_embeddings=True,
        encoder_normalize_before=True,
        decoder_normalize_before=True,
        moe_expert_count=ranks,
        moe_freq=1,
        moe_normalize_gate=True,
        moe_capacity_factor=1.0,
        moe_eval_capacity_factor=0.0,
    )
    model = {"encoder.embed_tokens.weight": torch.randn(vocab, dim)}
    model["decoder.embed_tokens.weight"] = model["decoder.output_projection.weight"] = model[
        "encoder.embed_tokens.weight"
    ]
    expert_keys = []
    for side in ("encoder", "decoder"):
        model[f"{side}.layer_norm.weight"], model[f"{side}.layer_norm.bias"] = torch.randn(dim), torch.randn(dim)
        for i in range(layers // 2):
            layer = f"{side}.layers.{i}"
            for part in ["self_attn"] + (["encoder_attn"] if side == "decoder" else []):
                for proj in ("q", "k", "v", "out"):
                    model[f"{layer}.{part}.{proj}_proj.weight"] = torch.randn(dim, dim)
                    model[f"{layer}.{part}.{proj}_proj.bias"] = torch.randn(dim)
                model[f"{layer}.{part}_layer_norm.weight"] = torch.randn(dim)
                model[f"{layer}.{part}_layer_norm.bias"] = torch.randn(dim)
            model[f"{layer}.final_layer_norm.weight"], model[f"{layer}.final_layer_norm.bias"] = (
                torch.randn(dim),
                torch.randn(dim),
            )
            model[f"{layer}.fc1.router.wg.weight"] = torch.randn(ranks, dim)
            stacked = {
                "batched_fc1_w": (hidden, dim),
                "batched_fc1_b": (hidden,),
                "batched_fc2_w": (dim, hidden),
                "batched_fc2_b": (dim,),
            }
            for tensor, shape in stacked.items():
                model[f"{layer}.fc1.experts.{tensor}"] = torch.randn(ranks, *shape)
                expert_keys.append(f"{layer}.fc1.experts.{tensor}")
    full = {
        "args": options,
        "model": model,
        "extra_state": {},
        "optimizer_history": [{"num_updates": 0}],
        "moe": moe_metadata([], expert_keys, 1, 0, 0, experts_per_worker=ranks),
    }
    save_set(full, name, ranks)


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def peak_growth(run) -> float:
    # ru_maxrss survives fork + exec, so a child would report the parent's peak (which wrote the set):
    # reset this process's high-water mark instead (Linux: 5 > clear_refs) and read VmHWM.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    run()
    return _status("VmHWM") - before


def measure(step: str, source: str, output: str, value: int) -> None:
    """In a fresh process: print the peak RSS growth (MiB) of one export (``export:<dtype>`` casts) or import."""
    from fairseq_moe_ext.checkpoint.hf.dtype import cast_dtype
    from fairseq_moe_ext.checkpoint.hf.exporter import export_hf
    from fairseq_moe_ext.checkpoint.hf.importer import import_hf

    if step.startswith("export"):
        dtype = cast_dtype(step.split(":")[1], "export-hf") if ":" in step else None
        print(f"{peak_growth(lambda: export_hf(source, output, value, report=lambda line: None, dtype=dtype)):.1f}")
    else:
        print(f"{peak_growth(lambda: import_hf(source, output, value, report=lambda line: None)):.1f}")


def fresh(*args) -> float:
    run = subprocess.run(
        [sys.executable, __file__, "--measure", *map(str, args)], capture_output=True, text=True, check=True
    )
    return float(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--shard-mb", type=int, default=16)
    parser.add_argument("--cast", default=None, help="also export with --dtype CAST (e.g. float16)")
    parser.add_argument("--measure", nargs=4, metavar=("STEP", "SOURCE", "OUTPUT", "VALUE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        step, source, output, value = args.measure
        measure(step, source, output, int(value))
        return
    with tempfile.TemporaryDirectory() as root:
        name = os.path.join(root, "set", "ck")
        os.mkdir(os.path.dirname(name))
        write_synthetic_set(name, args.ranks, args.layers, args.dim, args.hidden)
        files = sorted(os.path.join(root, "set", f) for f in os.listdir(os.path.join(root, "set")) if f.endswith(".pt"))
        sizes = [os.path.getsize(f) / MB for f in files]
        whole, first, rank = sum(sizes), sizes[0], sizes[-1]
        print(
            f"set: {args.ranks} rank files, rank 0 {first:.1f} MiB (shared + experts), others {rank:.1f} MiB, "
            f"{whole:.1f} MiB in all"
        )
        print(f"{'step':>12} {'peak MiB':>9} {'bound MiB':>10} {'peak/bound':>10} {'peak/whole':>10}")
        shard = args.shard_mb * 10**6
        peak = fresh("export", name + ".pt", os.path.join(root, "hf"), shard)
        bound = first + shard / MB
        print(f"{'export':>12} {peak:>9.1f} {bound:>10.1f} {peak / bound:>10.2f} {peak / whole:>10.2f}")
        if args.cast:
            peak = fresh(f"export:{args.cast}", name + ".pt", os.path.join(root, "hf-" + args.cast), shard)
            label = "export " + args.cast
            print(f"{label:>12} {peak:>9.1f} {bound:>10.1f} {peak / bound:>10.2f} {peak / whole:>10.2f}")
        for workers in (1, 4, 16):
            out = os.path.join(root, f"out{workers}")
            os.mkdir(out)
            peak = fresh("import", os.path.join(root, "hf"), os.path.join(out, "ck.pt"), workers)
            bound = first - rank + rank * args.ranks / workers  # rank 0's output file: shared + E/W experts
            print(
                f"{'import W=' + str(workers):>12} {peak:>9.1f} {bound:>10.1f} {peak / bound:>10.2f} "
                f"{peak / whole:>10.2f}"
            )


if __name__ == "__main__":
    main()
