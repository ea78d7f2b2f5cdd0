"""--moe-freeze and --moe-balance-scope global-batch through fairseq's own Trainer (hooks included).

Freezing, on 2 gloo workers, every data-parallel backend and the CPU precisions: the frozen parameters end the
update bit for bit as they started, with no gradient after the all-reduce (legacy_ddp would give a parameter it
reduced a gradient, zeros at least) and no optimizer state; the trained parameters make the update one process
makes with the same freeze. The global-batch scope: 2 workers x 2 micro-batches equal one process on the
same 2 micro-batches laid end to end (its estimator's promise, moe/balance_scope.py), and differ from the
micro-batch scope; a run restarted from the model and optimizer after update 1 makes update 2 bit for bit.
"""

import pytest
import torch

from support.launch.dist_utils import run_on_workers
from support.launch.in_process_trainer import (
    assert_step_equals_one_process,
    build_trainer,
    collate,
    micro_batches,
    one_step,
    training_args,
    write_dictionaries,
)

pytestmark = pytest.mark.slow

# (backend, parts frozen, extra flags); the shares of the batch are [5, 7] everywhere.
# fmt: off
FREEZE_CASES = [
    ("legacy_ddp", "router", []),
    ("no_c10d", "shared", []),
    ("c10d", "experts", []),
    ("pytorch_ddp", "router,experts", []),
    ("fully_sharded", "router,shared", []),
    ("legacy_ddp", "experts,shared", ["--bf16"]),
    ("legacy_ddp", "shared", ["--fp16", "--fp16-no-flatten-grads"]),
]
# fmt: on
SHARES = [5, 7]


def frozen_flags(backend, parts, extra):
    return ["--ddp-backend", backend, *extra, *(["--moe-freeze", parts] if parts else [])]


def whole(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def freeze_worker(rank, world, data_dir):
    results = []
    for backend, parts, extra in FREEZE_CASES:
        task, trainer = build_trainer(training_args(data_dir, world, frozen_flags(backend, parts, extra)))
        model = trainer.get_model()
        before = {n: whole(p).detach().clone() for n, p in model.named_parameters()}
        start = sum(SHARES[:rank])
        batches = [b[start : start + SHARES[rank]] for b in micro_batches(SHARES, 1)]
        result = one_step(task, trainer, *batches)
        params = dict(model.named_parameters())
        optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
        result.update(
            before=before,
            frozen=sorted(n for n, p in params.items() if not p.requires_grad),
            with_grad=sorted(n for n, p in params.items() if not p.requires_grad and p.grad is not None),
            optimized_frozen=sum(id(p) in optimized for p in params.values() if not p.requires_grad),
            optimized=len(optimized),
        )
        result["params"] = {n: whole(p) for n, p in result["params"].items()}
        results.append(result)
    return results


def test_frozen_parts_stay_bit_for_bit_without_gradient_and_the_rest_trains_as_one_process(tmp_path):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    by_rank = run_on_workers(freeze_worker, 2, data_dir)
    for i, (backend, parts, extra) in enumerate(FREEZE_CASES):
        results = [r[i] for r in by_rank]
        frozen = results[0]["frozen"]
        assert frozen, (backend, parts)
        if "router" in parts:
            assert any(".router." in n for n in frozen)
        for r in results:
            assert r["with_grad"] == [] and r["optimized_frozen"] == 0, (backend, parts)
            for name in frozen:
                assert torch.equal(r["params"][name], r["before"][name]), f"{name} moved ({backend}, {parts})"
            assert any(not torch.equal(r["params"][n], r["before"][n]) for n in r["params"] if n not in frozen)
        if not extra:  # the precisions round differently from the fp32 process
            assert_trained_as_one_process(results, data_dir, frozen_flags("legacy_ddp", parts, []))


def assert_trained_as_one_process(results, data_dir, flags):
    """The workers' update (experts by global id) equals one process's on the whole batch, with the same
    freeze (the gradient norm may stay below the clip here, which assert_step_equals_one_process demands)."""
    task, trainer = build_trainer(training_args(data_dir, 1, flags))
    reference = one_step(task, trainer, *micro_batches(SHARES, 1))
    assert results[0]["gnorm"] == pytest.approx(reference["gnorm"], rel=1e-5)
    experts = set(reference["expert_names"])
    for name, want in reference["params"].items():
        got = torch.cat([r["params"][name] for r in results]) if name in experts else results[0]["params"][name]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


GLOBAL = ["--update-freq", "2", "--moe-balance-scope", "global-batch"]


def scope_worker(rank, world, data_dir):
    task, trainer = build_trainer(training_args(data_dir, world, ["--ddp-backend", "legacy_ddp", *GLOBAL]))
    start = sum(SHARES[:rank])
    return one_step(task, trainer, *[b[start : start + SHARES[rank]] for b in micro_batches(SHARES, 2)])


def test_global_batch_scope_on_two_workers_and_two_micro_batches_equals_one_process(tmp_path):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    results = run_on_workers(scope_worker, 2, data_dir)
    assert_step_equals_one_process(results, data_dir, SHARES, GLOBAL, 2, parallel_size=2)
    task, trainer = build_trainer(training_args(data_dir, 1, ["--update-freq", "2"]))
    micro = one_step(task, trainer, *micro_batches(SHARES, 2))
    router = [n for n in micro["params"] if n.endswith("router.wg.weight")]
    assert router and any(not torch.equal(micro["params"][n], results[0]["params"][n]) for n in router)


def test_a_global_batch_run_restarted_after_an_update_makes_the_next_one_bit_for_bit(tmp_path):
    """The counts are the update's: nothing of update 1 is left for update 2, so the model and optimizer
    state (what a checkpoint holds) are all a restarted run needs."""
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    argv = training_args(data_dir, 1, GLOBAL)
    updates = [micro_batches([6], 2), [b[::-1] for b in micro_batches([5], 2)]]
    task, straight = build_trainer(argv)
    for batches in updates:
        straight.train_step([collate(task, pairs) for pairs in batches])
    task, restarted = build_trainer(argv)
    restarted.get_model().load_state_dict(straight_after_one_update(argv, updates[0]))
    restarted.train_step([collate(task, pairs) for pairs in updates[1]])
    for (name, want), got in zip(
        straight.get_model().state_dict().items(), restarted.get_model().state_dict().values()
    ):
        assert torch.equal(got, want), name
    micro_keys = build_trainer(training_args(data_dir, 1))[1].get_model().state_dict().keys()
    assert straight.get_model().state_dict().keys() == micro_keys  # nothing of the scope is saved


def straight_after_one_update(argv, batches):
    task, trainer = build_trainer(argv)
    trainer.train_step([collate(task, pairs) for pairs in batches])
    return {n: t.clone() for n, t in trainer.get_model().state_dict().items()}


def test_a_global_batch_update_after_an_fp16_overflow_counts_only_its_own_micro_batches(tmp_path, monkeypatch):
    """An inf in an expert gradient makes fp16 skip update 1; update 2's counts are update 2's alone, as a
    fresh trainer running only update 2 counts them."""
    from support.inputs.gradient_overflow import PRECISIONS, first_expert_parameter, inject_once, with_adam

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)  # fairseq's skipped-step norm
    write_dictionaries(str(tmp_path))
    argv = with_adam(training_args(str(tmp_path), 1, [*GLOBAL, *PRECISIONS["fp16 (not flattened)"]]))
    second = micro_batches([5], 2)
    counts = []
    for skipped_first in (True, False):
        task, trainer = build_trainer(argv)
        if skipped_first:
            inject_once(first_expert_parameter(trainer.get_model()), float("inf"))
            trainer.train_step([collate(task, pairs) for pairs in micro_batches([6], 2)])
            assert trainer.get_num_updates() == 0, "the overflow should have skipped the step"
        trainer.train_step([collate(task, pairs) for pairs in second])
        assert trainer.get_num_updates() == 1
        layers = [m for m in trainer.get_model().modules() if getattr(m, "update_load", None) is not None]
        counts.append([(layer.update_load.counts.clone(), layer.update_load.tokens.clone()) for layer in layers])
    assert len(counts[0]) == 2
    for (got, got_tokens), (want, want_tokens) in zip(*counts):
        assert torch.equal(got, want) and torch.equal(got_tokens, want_tokens)
