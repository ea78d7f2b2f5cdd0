"""Peak memory of ``import-fairseq-moe`` on a synthetic 16-rank moe/nllb-branch set.

    python benchmarks/import_memory.py [--ranks 16] [--layers 4] [--dim 256] [--hidden 2048]

Writes a branch set (``<prefix>-shared.pt`` + 16 ``-rank-N.pt`` files, one expert each in every
MoE layer, fp32) into a temporary directory, then imports it into W = 1, 4 and 16 output files, each
in a fresh process, and prints the process's peak resident memory above what it held before the
import started (torch and the package imported), beside the sizes the import should stay near:
the shared file plus one rank file plus one output file's experts. W = 1 writes every expert into
one file, so its peak is the whole model by construction; with W = 16 each output file holds
1/16 of the experts.
"""

import argparse
import os
import resource
import subprocess
import sys
import tempfile

import torch

MB = 1 << 20


def write_synthetic_set(prefix: str, ranks: int, layers: int, dim: int, hidden: int, vocab: int = 8000) -> None:
    options = argparse.Namespace(
        arch="transformer",
        moe_expert_count=ranks,
        moe_freq=1,
        encoder_layers=layers // 2,
        decoder_layers=layers // 2,
        encoder_ffn_embed_dim=hidden,
        decoder_ffn_embed_dim=hidden,
        moe_second_expert_policy="all",
        moe_eval_capacity_token_fraction=1.0,
    )
    moe_layers = [f"{side}.layers.{i}" for side in ("encoder", "decoder") for i in range(layers // 2)]
    shared = {f"{layer}.moe_layer.gate.wg.weight": torch.randn(ranks, dim) for layer in moe_layers}
    shared["encoder.embed_tokens.weight"] = torch.randn(vocab, dim)
    shared["decoder.embed_tokens.weight"] = torch.randn(vocab, dim)
    torch.save({"model": shared}, f"{prefix}-shared.pt")
    cfg = {"model": options, "distributed_training": {"distributed_world_size": ranks}}
    for rank in range(ranks):
        model = {}
        for layer in moe_layers:
            model[f"{layer}.moe_layer.experts.0.fc1.weight"] = torch.randn(hidden, dim)
            model[f"{layer}.moe_layer.experts.0.fc1.bias"] = torch.randn(hidden)
            model[f"{layer}.moe_layer.experts.0.fc2.weight"] = torch.randn(dim, hidden)
            model[f"{layer}.moe_layer.experts.0.fc2.bias"] = torch.randn(dim)
        torch.save({"cfg": cfg, "model": model, "optimizer_history": [{"num_updates": 1}]}, f"{prefix}-rank-{rank}.pt")


def measure_one(prefix: str, output: str, workers: int) -> None:
    """In a fresh process: print the peak RSS growth (MiB) of one import."""
    from fairseq_moe_ext.checkpoint.branch_import import import_branch_set

    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    import_branch_set(prefix, output, workers, report=lambda line: None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"{(peak - before) / MB:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--measure", nargs=3, metavar=("PREFIX", "OUTPUT", "W"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure_one(args.measure[0], args.measure[1], int(args.measure[2]))
        return
    with tempfile.TemporaryDirectory() as root:
        prefix = os.path.join(root, "checkpoint_best")
        write_synthetic_set(prefix, args.ranks, args.layers, args.dim, args.hidden)
        shared = os.path.getsize(f"{prefix}-shared.pt") / MB
        rank = os.path.getsize(f"{prefix}-rank-0.pt") / MB
        whole = shared + args.ranks * rank
        print(f"set: {args.ranks} rank files of {rank:.1f} MiB + shared {shared:.1f} MiB = {whole:.1f} MiB")
        print(f"{'W':>3} {'peak MiB':>9} {'bound MiB':>10} {'peak/bound':>10} {'peak/whole':>10}")
        for workers in (1, 4, 16):
            out = os.path.join(root, f"out{workers}")
            os.mkdir(out)
            run = subprocess.run(
                [sys.executable, __file__, "--measure", prefix, os.path.join(out, "imported.pt"), str(workers)],
                capture_output=True,
                text=True,
                check=True,
            )
            peak = float(run.stdout.strip().splitlines()[-1])
            # shared + one source rank file + one output file's experts (+ the shared part it also holds)
            bound = shared + rank + max(1, args.ranks // workers) * rank
            print(f"{workers:>3} {peak:>9.1f} {bound:>10.1f} {peak / bound:>10.2f} {peak / whole:>10.2f}")


if __name__ == "__main__":
    main()
