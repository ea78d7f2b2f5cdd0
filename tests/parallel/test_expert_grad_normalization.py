"""``--moe-normalize-expert-grad`` through fairseq's own Trainer: the gradients a step leaves behind.

fairseq's ``train_step`` all-reduces, multiplies by ``W / sample_size`` and clips (``--clip-norm 0``
here: it only measures) and leaves the gradients on the parameters. With the default ``world_size``
every gradient on 2 gloo workers (P = 2) equals the one-process gradient of the whole batch; with
``sqrt_world_size`` (the nllb branch's option) every expert gradient is sqrt(2) times it and every
other gradient is unchanged, on each ddp backend; on one process the option changes nothing.
"""

import math

import pytest
import torch

from support.launch.dist_utils import run_on_workers
from support.launch.in_process_trainer import build_trainer, collate, micro_batches, training_args, write_dictionaries

pytestmark = pytest.mark.slow

SHARES = [5, 7]
SQRT = ["--moe-normalize-expert-grad", "sqrt_world_size"]
# (backend, extra flags, P); pytorch_ddp is fairseq's alias of c10d. P = 1: both workers hold every expert
# (2 replicas), where the branch divides by sqrt(W / replicas) = 1, so the gradient stays exact.
CASES = [
    ("legacy_ddp", [], 2),
    ("legacy_ddp", SQRT, 2),
    ("c10d", SQRT, 2),
    ("no_c10d", SQRT, 2),
    ("fully_sharded", SQRT, 2),
    ("legacy_ddp", [*SQRT, "--moe-expert-parallel-size", "1"], 1),
]


def gradients_after_one_step(data_dir, world, pairs, flags):
    task, trainer = build_trainer(training_args(data_dir, world, ["--clip-norm", "0", *flags]))
    trainer.train_step([collate(task, pairs)])
    model = trainer.get_model()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    experts = [n for n, p in model.named_parameters() if getattr(p, "expert", False)]
    return {"grads": {n: g.detach().clone() for n, g in grads.items()}, "expert_names": experts}


def cases_worker(rank, world, data_dir):
    (batch,) = micro_batches(SHARES, 1)
    mine = batch[sum(SHARES[:rank]) : sum(SHARES[: rank + 1])]
    return [gradients_after_one_step(data_dir, world, mine, ["--ddp-backend", b, *f]) for b, f, _ in CASES]


def test_sqrt_world_size_leaves_expert_grads_sqrt_p_times_exact_on_every_backend(tmp_path):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    by_rank = run_on_workers(cases_worker, 2, data_dir)
    (batch,) = micro_batches(SHARES, 1)
    exact = gradients_after_one_step(data_dir, 1, batch, [])
    one_process = gradients_after_one_step(data_dir, 1, batch, SQRT)
    for name, want in exact["grads"].items():
        assert torch.equal(one_process["grads"][name], want), f"{name}: the option changed one process's gradient"
    experts = set(exact["expert_names"])
    assert experts and experts == set(by_rank[0][0]["expert_names"])
    for i, (backend, flags, parallel) in enumerate(CASES):
        results = [r[i] for r in by_rank]
        factor = math.sqrt(parallel) if flags else 1.0
        for name, want in exact["grads"].items():
            if name in experts:  # by global id: with P = 2 rank r holds experts 2r, 2r+1
                got, scale = torch.cat([r["grads"][name] for r in results[:parallel]]), factor
                if parallel == 1:
                    assert torch.equal(results[1]["grads"][name], got), f"{name} differs between replicas"
            else:
                got, scale = results[0]["grads"][name], 1.0
                assert torch.equal(results[1]["grads"][name], got), f"{backend}: {name} differs between workers"
            assert want.abs().max() > 0, name
            torch.testing.assert_close(got, scale * want, rtol=1e-4, atol=1e-6, msg=f"{backend} {flags}: {name}")
