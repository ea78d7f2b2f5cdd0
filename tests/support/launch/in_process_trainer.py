"""fairseq's own Trainer in this process (or in each gloo worker): dictionaries, a tiny reversal
task's sentence pairs, the training flags of the expert-parallel oracle, a Trainer built the way
fairseq-train builds one, a batch collated from pairs, one logged step, and the comparison of the
workers' step with one process's. Used by the oracles of tests/fairseq/.
"""

import os

import pytest
import torch
import torch.distributed as dist

from support.launch.fairseq_helpers import translation_flags

VOCAB = [f"w{i}" for i in range(30)]


def write_dictionaries(data_dir):
    os.makedirs(data_dir, exist_ok=True)
    for lang in ("src", "tgt"):
        with open(os.path.join(data_dir, f"dict.{lang}.txt"), "w") as f:
            f.writelines(f"{w} 1\n" for w in VOCAB)


def sentence_pairs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        length = int(torch.randint(2, 9, (1,), generator=g))
        src = torch.randint(len(VOCAB), (length,), generator=g)
        pairs.append((src, src.flip(0)))
    return pairs


def training_args(data_dir, world_size, extra=()):
    return [
        *translation_flags(data_dir, "moe_transformer_tiny"),
        "--moe-expert-count",
        "4",
        "--moe-top-k",
        "2",
        "--dropout",
        "0",
        "--attention-dropout",
        "0",
        "--criterion",
        "moe_label_smoothed_cross_entropy",
        "--label-smoothing",
        "0.1",
        "--moe-gate-loss-wt",
        "0.5",
        "--moe-z-loss-wt",
        "0.05",
        "--optimizer",
        "sgd",
        "--momentum",
        "0",
        "--lr",
        "0.5",
        "--clip-norm",
        "0.7",
        "--cpu",
        "--seed",
        "3",
        "--distributed-world-size",
        str(world_size),
        "--distributed-backend",
        "gloo",
        *extra,
    ]


def build_trainer(argv):
    from fairseq.trainer import Trainer

    from fairseq import tasks
    from support.inputs.tiny_fairseq_models import train_config

    cfg = train_config(argv)
    if dist.is_initialized():
        cfg.distributed_training.distributed_rank = dist.get_rank()
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    return task, Trainer(cfg, task, model, criterion)


def collate(task, pairs):
    from fairseq.data import LanguagePairDataset

    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    to_ids = lambda d, t: torch.cat([t + d.nspecial, torch.tensor([d.eos()])])
    src = [to_ids(src_dict, s) for s, _ in pairs]
    tgt = [to_ids(tgt_dict, t) for _, t in pairs]
    dataset = LanguagePairDataset(src, [len(s) for s in src], src_dict, tgt, [len(t) for t in tgt], tgt_dict)
    return dataset.collater([dataset[i] for i in range(len(pairs))])


def one_step(task, trainer, *micro_batches, steps=1):
    """``steps`` updates (each on the same micro-batches), logged together."""
    from fairseq.logging import metrics

    buffers = []
    with metrics.aggregate(new_root=True) as agg:
        for _ in range(steps):
            trainer.train_step([collate(task, pairs) for pairs in micro_batches])
            buffers.append({n: b.detach().clone() for n, b in trainer.get_model().named_buffers()})
    model = trainer.get_model()
    return {  # meters' raw averages: the smoothed values are rounded for display
        "loss": float(agg["loss"].avg),
        "gate_loss": float(agg["moe_gate_loss"].avg),
        "gnorm": float(agg["gnorm"].avg),
        "dropped": float(agg["moe_dropped_frac"].avg),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": buffers,  # after each step
        "expert_names": [n for n, p in model.named_parameters() if getattr(p, "expert", False)],
    }


def micro_batches(shares, count):
    """``count`` micro-batches, each of ``sum(shares)`` sentence pairs."""
    return [sentence_pairs(sum(shares), seed=i) for i in range(count)]


def without_fully_sharded_options(flags):
    """``flags`` less the options that act under --ddp-backend fully_sharded only, with their values: what a
    run under another backend, or one process, takes (it refuses them: models/moe_runtime.FULLY_SHARDED_ONLY)."""
    from fairseq_moe_ext.models.moe_runtime import FULLY_SHARDED_ONLY

    dropped = {"--" + name.replace("_", "-") for name, _, _ in FULLY_SHARDED_ONLY}
    flags = [str(f) for f in flags]
    return [f for i, f in enumerate(flags) if f not in dropped and (i == 0 or flags[i - 1] not in dropped)]


def assert_step_equals_one_process(results, data_dir, shares, extra, count, parallel_size, steps=1):
    """The workers' step (``results`` by rank) equals one process's step on the whole batch. Rank r
    holds the experts of ``ep_rank = r % parallel_size`` (global ids ``ep_rank*E/P ..``); ranks of the
    same ep_rank hold replicas, which must be bitwise identical. Buffers (the balance biases) are
    shared state: bitwise identical on every worker, and equal to the single process's."""
    task, trainer = build_trainer(training_args(data_dir, 1, without_fully_sharded_options(extra)))
    reference = one_step(task, trainer, *micro_batches(shares, count), steps=steps)
    assert (reference["dropped"] > 0) == ("--moe-capacity-factor" in extra)

    for r in results:
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert r["gate_loss"] == pytest.approx(reference["gate_loss"], rel=1e-5)
        assert r["gnorm"] == pytest.approx(reference["gnorm"], rel=1e-5)
        assert r["gnorm"] > 0.7, "the case should exercise clipping"
    experts = set(reference["expert_names"])
    assert experts and experts == set(results[0]["expert_names"])
    for name, want in reference["params"].items():
        for rank, r in enumerate(results):
            replica_of = results[rank % parallel_size] if name in experts else results[0]
            assert torch.equal(r["params"][name], replica_of["params"][name]), f"{name} differs between replicas"
        if name in experts:
            got = torch.cat([r["params"][name] for r in results[:parallel_size]])  # by global id
        else:
            got = results[0]["params"][name]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)
    for step, buffers in enumerate(reference["buffers"]):
        for name, want in buffers.items():
            for r in results:
                assert torch.equal(r["buffers"][step][name], results[0]["buffers"][step][name]), f"{name} differs"
            torch.testing.assert_close(results[0]["buffers"][step][name], want, rtol=0, atol=1e-7, msg=name)


def replicated_case_flags(experts, parallel, extra):
    given = [] if parallel is None else ["--moe-expert-parallel-size", str(parallel)]
    return ["--moe-expert-count", str(experts), *given, *extra]
