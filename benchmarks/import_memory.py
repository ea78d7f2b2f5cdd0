"""Peak memory and read rate of ``import-fairseq-moe`` on a synthetic moe/nllb-branch set shaped as the
NLLB-200 MoE release is: fp16 weights, and in every file ``last_optimizer_state`` with fp16 Adam moments.

    python benchmarks/import_memory.py [--ranks 16] [--layers 4] [--dim 256] [--hidden 2048]
    python benchmarks/import_memory.py --hub [--experts 16] [--shard-mb 16] [--layers 4] [--dim 256] [--hidden 2048]

Writes a branch set (``<prefix>-shared.pt`` + 16 ``-rank-N.pt`` files, one expert each in every MoE
layer) into a temporary directory, then imports it into W = 1, 8 and 16 output files, each in a fresh
process, twice: with the import's reader (``one_read.load_skipping``: each byte once, the optimizer
state never) and, side by side, with the reader it replaced (``safe_load``: a CRC pass over the whole
file, then ``torch.load`` of all of it). For each it prints the process's peak resident memory above
what it held before the import (torch and the package imported) and its ratio to the bound the import
promises: the shared file's model + one rank file's model + one output file's experts (rank 0's output
file holds the shared model too, the same tensors), none of it optimizer state; and the rate, in input-file bytes per second of wall time
(reading, checking replicas, writing the output) and per second of the process's CPU time (the rate
one free core reaches when the disk keeps up). W = 1 writes every expert into one file, so its
bound is the whole model by construction. The last column is the rate per weight byte (the bytes of the
files' models, all the import reads of them: the optimizer state is skipped), in MB (10^6 bytes) per CPU second.

``--hub``: ``import-hf`` of the hub's NLLB-MoE layout (``facebook/nllb-moe-54b``: fp32 ``pytorch_model-*.bin``
shards and their index, base-model names), written by transformers' own ``NllbMoeModel.save_pretrained
(safe_serialization=False, max_shard_size=...)`` (the last step of transformers' converter, which wrote the hub's
copy; transformers is a test-only dependency, needed here) for a random model with every layer an MoE layer, so
that each shard holds some experts of a layer and every output rank file needs every shard. Imported at W = 1 and
8, each in a fresh process, with the import's reader (``seek``: each tensor's archive member on its own) and the one
it replaced (``whole``: a shard loaded whole, once per output file that needs it); for each: the peak as above, the
bound the import promises (the largest shard + the output file being written: rank 0's, which also holds the
shared weights), the bytes read of the shards over their size, and the rate in weight bytes per CPU second.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

MB = 1 << 20


def adam(tensors):
    """The branch's per-parameter state (--fp16-adam-stats): fp16 moments beside each fp16 parameter."""
    return {
        "state": {
            i: {"step": 1, "exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t), "exp_avg_scale": 1.0}
            for i, t in enumerate(tensors.values())
        },
        "param_groups": [{"lr": [0.002], "params": list(range(len(tensors)))}],
        "loss_scale": 8.0,
    }


def write_synthetic_set(prefix: str, ranks: int, layers: int, dim: int, hidden: int, vocab: int = 8000):
    """Returns (bytes of the shared model, bytes of one rank file's model)."""
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
    half = torch.float16
    moe_layers = [f"{side}.layers.{i}" for side in ("encoder", "decoder") for i in range(layers // 2)]
    shared = {f"{layer}.moe_layer.gate.wg.weight": torch.randn(ranks, dim, dtype=half) for layer in moe_layers}
    shared["encoder.embed_tokens.weight"] = torch.randn(vocab, dim, dtype=half)
    shared["decoder.embed_tokens.weight"] = torch.randn(vocab, dim, dtype=half)
    cfg = {"model": options, "distributed_training": {"distributed_world_size": ranks}}
    head = {"cfg": cfg, "optimizer_history": [{"num_updates": 1}]}
    torch.save({**head, "model": shared, "last_optimizer_state": adam(shared)}, f"{prefix}-shared.pt")
    for rank in range(ranks):
        model = {}
        for layer in moe_layers:
            model[f"{layer}.moe_layer.experts.0.fc1.weight"] = torch.randn(hidden, dim, dtype=half)
            model[f"{layer}.moe_layer.experts.0.fc1.bias"] = torch.randn(hidden, dtype=half)
            model[f"{layer}.moe_layer.experts.0.fc2.weight"] = torch.randn(dim, hidden, dtype=half)
            model[f"{layer}.moe_layer.experts.0.fc2.bias"] = torch.randn(dim, dtype=half)
        torch.save({**head, "model": model, "last_optimizer_state": adam(model)}, f"{prefix}-rank-{rank}.pt")
    size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors.values())  # noqa: E731
    return size(shared), size(model)


def measure_one(prefix: str, output: str, workers: int, loader: str) -> None:
    """In a fresh process: print the peak RSS growth (MiB), the wall time and the CPU time (s) of one import."""
    from fairseq_moe_ext.checkpoint.branch import importer as branch_import
    from fairseq_moe_ext.checkpoint.safe_load import safe_load

    if loader == "safe_load":  # the reader before one_read: CRC pass, then torch.load of everything
        branch_import.load_skipping = lambda path, on_read=None: safe_load(path)
    peak, elapsed, cpu = measured(
        lambda: branch_import.import_branch_set(prefix, output, workers, report=lambda _: None)
    )
    print(f"{peak:.1f} {elapsed:.3f} {cpu:.3f}")


def measured(run):
    """(peak RSS growth in MiB, wall seconds, CPU seconds) of ``run()`` in this process. Not ru_maxrss: it survives
    fork + exec, so a child would report the parent's peak (the parent wrote the set). This process's high-water
    mark is reset (Linux: 5 > clear_refs) and VmHWM read."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    run()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return (_status_kib("VmHWM") - before) / 1024, elapsed, cpu


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def run_one(prefix: str, root: str, workers: int, loader: str, mode: str = "--measure"):
    """The numbers a fresh process measuring one import (``mode``: ``--measure`` or ``--measure-hub``) prints."""
    out = os.path.join(root, f"out-{loader}-{workers}")
    os.mkdir(out)
    run = subprocess.run(
        [sys.executable, __file__, mode, prefix, os.path.join(out, "imported.pt"), str(workers), loader],
        capture_output=True,
        text=True,
        check=True,
    )
    return tuple(float(x) for x in run.stdout.strip().splitlines()[-1].split())


def write_hub_set(out: str, experts: int, layers: int, dim: int, hidden: int, shard_mb: int, vocab: int = 8000):
    """The hub's layout in ``out``; returns (bytes of the shared weights, of one expert, of the largest shard)."""
    from transformers import NllbMoeConfig, NllbMoeModel

    config = NllbMoeConfig(
        vocab_size=vocab, d_model=dim, encoder_layers=layers // 2, decoder_layers=layers // 2, encoder_ffn_dim=hidden,
        decoder_ffn_dim=hidden, encoder_attention_heads=4, decoder_attention_heads=4, num_experts=experts,
        encoder_sparse_step=1, decoder_sparse_step=1, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = NllbMoeModel(config)
    model.save_pretrained(out, safe_serialization=False, max_shard_size=f"{shard_mb}MB")
    size = lambda named: sum(t.numel() * t.element_size() for _, t in named)  # noqa: E731
    expert = size(model.encoder.layers[0].ffn.experts["expert_0"].named_parameters())
    shared = size(model.named_parameters()) - expert * experts * layers
    shards = [os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".bin")]
    return shared, expert, max(shards)


def measure_hub_one(hub: str, output: str, workers: int, reader: str) -> None:
    """In a fresh process: peak RSS growth (MiB), wall and CPU seconds, and bytes read of the shards."""
    from fairseq_moe_ext.checkpoint import one_read
    from fairseq_moe_ext.checkpoint.hf import importer, torch_bin_file

    if reader == "whole":  # the reader before: a .bin shard loaded whole, once per output file needing it

        def whole(path):
            raise one_read.NotOneRead(path)

        torch_bin_file.OpenCheckpoint = whole
    read, real = [0], one_read.CountingReader

    class Counting(real):
        def readinto(self, buffer):
            count = super().readinto(buffer)
            read[0] += count or 0
            return count

    one_read.CountingReader = Counting
    peak, elapsed, cpu = measured(lambda: importer.import_hf(hub, output, workers, report=lambda line: None))
    print(f"{peak:.1f} {elapsed:.3f} {cpu:.3f} {read[0]}")


def hub_main(args) -> None:
    with tempfile.TemporaryDirectory() as root:
        hub = os.path.join(root, "hub")
        shared, expert, largest = write_hub_set(hub, args.experts, args.layers, args.dim, args.hidden, args.shard_mb)
        files = [f for f in os.listdir(hub) if f.endswith(".bin")]
        total = sum(os.path.getsize(os.path.join(hub, f)) for f in files)
        weights = shared + expert * args.experts * args.layers
        print(
            f"hub layout: {len(files)} .bin shards, {total / MB:.1f} MiB (largest {largest / MB:.1f} MiB); weights "
            f"{weights / MB:.1f} MiB fp32: shared {shared / MB:.1f}, {args.layers} MoE layers of {args.experts} experts "
            f"of {expert / MB:.2f}"
        )
        print(
            f"{'W':>3} {'reader':>6} {'peak MiB':>9} {'bound MiB':>10} {'peak/bound':>10} {'read/shards':>11} "
            f"{'weight MB/s CPU':>15}"
        )
        for workers in (1, 8):
            output = shared + expert * args.layers * max(1, args.experts // workers)  # rank 0's output file
            bound = (largest + output) / MB
            for reader in ("seek", "whole"):
                peak, _, cpu, read = run_one(hub, root, workers, reader, mode="--measure-hub")
                print(
                    f"{workers:>3} {reader:>6} {peak:>9.1f} {bound:>10.1f} {peak / bound:>10.2f} {read / total:>11.2f} "
                    f"{weights / 1e6 / cpu:>15.1f}"
                )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--hub", action="store_true", help="import-hf of the hub's layout (.bin shards)")
    parser.add_argument("--experts", type=int, default=16, help="--hub: experts per MoE layer")
    parser.add_argument("--shard-mb", type=int, default=16, help="--hub: save_pretrained's max_shard_size in MB")
    parser.add_argument("--measure", nargs=4, metavar=("PREFIX", "OUTPUT", "W", "LOADER"), help=argparse.SUPPRESS)
    parser.add_argument("--measure-hub", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure_one(args.measure[0], args.measure[1], int(args.measure[2]), args.measure[3])
        return
    if args.measure_hub:
        measure_hub_one(args.measure_hub[0], args.measure_hub[1], int(args.measure_hub[2]), args.measure_hub[3])
        return
    if args.hub:
        hub_main(args)
        return
    with tempfile.TemporaryDirectory() as root:
        prefix = os.path.join(root, "checkpoint_best")
        shared_model, rank_model = (b / MB for b in write_synthetic_set(prefix, **_shape(args)))
        shared = os.path.getsize(f"{prefix}-shared.pt") / MB
        rank = os.path.getsize(f"{prefix}-rank-0.pt") / MB
        files = shared + args.ranks * rank
        print(
            f"set: {args.ranks} rank files of {rank:.1f} MiB (model {rank_model:.1f} MiB, the rest optimizer state) "
            f"+ shared {shared:.1f} MiB (model {shared_model:.1f} MiB) = {files:.1f} MiB"
        )
        weights = shared_model + args.ranks * rank_model  # what the import reads: the files' weights
        print(
            f"{'W':>3} {'reader':>10} {'peak MiB':>9} {'bound MiB':>10} {'peak/bound':>10} {'MiB/s wall':>10} "
            f"{'MiB/s CPU':>9} {'weight MB/s CPU':>15}"
        )
        for workers in (1, 8, 16):
            # shared model + one source rank file's model + one output file's experts (rank 0's output file also
            # holds the shared model: the same tensors, not a copy)
            bound = shared_model + rank_model + max(1, args.ranks // workers) * rank_model
            rows = {}
            for loader in ("one_read", "safe_load"):
                peak, seconds, cpu = rows[loader] = run_one(prefix, root, workers, loader)
                print(
                    f"{workers:>3} {loader:>10} {peak:>9.1f} {bound:>10.1f} {peak / bound:>10.2f} "
                    f"{files / seconds:>10.1f} {files / cpu:>9.1f} {weights * MB / 1e6 / cpu:>15.1f}"
                )
            (new_peak, new_s, new_cpu), (old_peak, old_s, old_cpu) = rows["one_read"], rows["safe_load"]
            print(
                f"    W={workers}: one_read / safe_load: peak {new_peak / old_peak:.2f}, wall {new_s / old_s:.2f}, "
                f"CPU {new_cpu / old_cpu:.2f}"
            )


def _shape(args):
    return dict(ranks=args.ranks, layers=args.layers, dim=args.dim, hidden=args.hidden)


if __name__ == "__main__":
    main()
