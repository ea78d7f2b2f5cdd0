"""Expert-parallel training through fairseq's own Trainer equals single-process training.

Each gloo worker runs one real ``Trainer.train_step`` (fairseq's all-reduce, gradient scaling,
clipping and optimizer step, with this plugin's hooks) on its share of a batch; a single process
holding every expert runs the same step on the whole batch. Loss, gradient norm and every updated
parameter (experts mapped by global id) must agree. SGD without momentum is used on purpose: Adam's
first step is invariant to gradient scale and would hide a wrong expert-gradient factor.
"""

import math

import pytest
import torch

from support.launch.dist_utils import run_on_workers
from support.launch.in_process_trainer import (
    assert_step_equals_one_process,
    build_trainer,
    collate,
    micro_batches,
    one_step,
    replicated_case_flags,
    sentence_pairs,
    training_args,
    write_dictionaries,
)

pytestmark = pytest.mark.slow


def expert_parallel_worker(rank, world, data_dir, shares, backend, extra, count, steps=1):
    task, trainer = build_trainer(training_args(data_dir, world, ["--ddp-backend", backend, *extra]))
    start = sum(shares[:rank])
    return one_step(
        task, trainer, *[b[start : start + shares[rank]] for b in micro_batches(shares, count)], steps=steps
    )


@pytest.mark.parametrize(
    "backend, shares, extra, count",
    [
        ("legacy_ddp", [6, 6], [], 1),
        ("legacy_ddp", [3, 9], [], 1),  # unequal token counts per worker
        ("c10d", [5, 7], [], 1),
        ("no_c10d", [8, 4], [], 1),
        # Overflowing experts drop slots. Batch-prioritised routing makes which ones a function of the
        # router scores alone: in batch order it would depend on how fairseq's collater sorts the
        # single process's batch, which differs from the workers' batches laid end to end.
        ("legacy_ddp", [5, 7], ["--moe-capacity-factor", "0.5", "--moe-batch-prioritized-routing"], 1),
        ("pytorch_ddp", [4, 6], ["--update-freq", "2"], 2),  # gradient accumulation; c10d is its alias in fairseq
    ],
)
def test_one_trainer_step_on_two_workers_equals_one_process_with_all_experts(tmp_path, backend, shares, extra, count):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    results = run_on_workers(expert_parallel_worker, 2, data_dir, shares, backend, extra, count)

    assert_step_equals_one_process(results, data_dir, shares, extra, count, parallel_size=2)


# fmt: off
ROUTING_EXTENSIONS = ["--moe-shared-expert-count", "2", "--moe-router", "sigmoid", "--moe-balance", "bias",
                      "--moe-bias-update-rate", "0.05", "--update-freq", "2"]
# fmt: on


def test_two_steps_with_shared_experts_sigmoid_and_bias_on_two_workers_equal_one_process(
    tmp_path,
):
    """The first update moves the bias from the load of both micro-batches on both workers, the
    second chooses experts with it; shared experts are averaged like any shared parameter."""
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    shares = [4, 6]
    results = run_on_workers(expert_parallel_worker, 2, data_dir, shares, "legacy_ddp", ROUTING_EXTENSIONS, 2, 2)

    assert_step_equals_one_process(results, data_dir, shares, ROUTING_EXTENSIONS, 2, parallel_size=2, steps=2)
    biases = {n: b for n, b in results[0]["buffers"][0].items() if n.endswith("balance_bias.bias")}
    assert len(biases) == 2 and all(b.abs().max() > 0 for b in biases.values()), "the first update moves each bias"
    shared = [n for n in results[0]["params"] if ".shared_experts." in n]
    assert shared and not set(shared) & set(results[0]["expert_names"])


# Four workers, P < W: E experts over P-worker groups, W/P replicas of each. Every (E, P) once, each
# backend at least twice, equal and unequal token counts, with and without drops, P given and by
# default; one spawn for all (four fairseq processes on two cores take about 20 s to start).
# fmt: off
REPLICATED_CASES = [
    # (E, P given or None for the default gcd(W, E), backend, shares, extra)
    (2, None, "legacy_ddp", [3, 3, 3, 3], []),
    (4, 2, "c10d", [2, 5, 3, 4], ["--moe-capacity-factor", "0.5", "--moe-batch-prioritized-routing"]),
    (8, None, "c10d", [4, 2, 5, 3], []),
    (2, 2, "legacy_ddp", [5, 1, 4, 2], ["--moe-capacity-factor", "0.75", "--moe-batch-prioritized-routing"]),
    (3, None, "legacy_ddp", [4, 3, 2, 3], []),  # 3 experts on 4 workers: P = 1, every worker holds all three
]
# fmt: on


def replicated_cases_worker(rank, world, data_dir):
    return [
        expert_parallel_worker(rank, world, data_dir, shares, backend, replicated_case_flags(e, p, extra), 1)
        for e, p, backend, shares, extra in REPLICATED_CASES
    ]


def test_a_step_on_four_workers_with_replicated_experts_equals_one_process(tmp_path):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    by_rank = run_on_workers(replicated_cases_worker, 4, data_dir)
    for i, (experts, parallel, backend, shares, extra) in enumerate(REPLICATED_CASES):
        results = [r[i] for r in by_rank]
        parallel_size = parallel or math.gcd(4, experts)  # the default
        assert results[0]["params"][results[0]["expert_names"][0]].shape[0] == experts // parallel_size
        assert_step_equals_one_process(
            results, data_dir, shares, replicated_case_flags(experts, parallel, extra), 1, parallel_size
        )


def router_update_and_balance_gradient(data_dir, gate_loss_wt):
    """One single-process step without clipping: the decoder router's gradient as the update reveals
    it (SGD: ``-lr * grad``), and the gradient of the GShard/Switch balance loss w.r.t. that router's
    weight, written from its definition on the router's input tokens."""
    from support.oracles.router_loss_definitions import switch_balance_loss

    argv = training_args(data_dir, 1, ["--clip-norm", "0"])
    argv[argv.index("--moe-gate-loss-wt") + 1] = str(gate_loss_wt)
    task, trainer = build_trainer(argv)
    layer = trainer.get_model().decoder.layers[1].fc1
    router = layer.router
    before = router.wg.weight.detach().clone()
    seen, reals = [], []  # the router scores pad tokens too; the layer counts only the real ones

    def route_tokens(tokens, real=None, _route=layer.route_tokens):
        reals.append(torch.ones(tokens.shape[0], dtype=torch.bool) if real is None else real)
        return _route(tokens, real)

    layer.route_tokens = route_tokens
    hook = router.register_forward_hook(lambda m, inputs, routing: seen.append((inputs[0].detach(), routing)) and None)
    trainer.train_step([collate(task, sentence_pairs(12))])
    hook.remove()
    del layer.route_tokens
    ((tokens, routing),), (real,) = seen, reals
    weight = before.clone().requires_grad_()
    logits = tokens[real].float() @ weight.t()
    top1 = routing.expert_index[real, 0]
    assert torch.equal(top1, logits.detach().argmax(-1))
    (balance_gradient,) = torch.autograd.grad(switch_balance_loss(logits, top1), weight)
    return (before - router.wg.weight.detach()) / 0.5, balance_gradient


def test_the_reference_steps_router_gradient_carries_the_defined_balance_loss_gradient(tmp_path):
    """The single-process step that the workers are compared with shares the plugin's loss code; this
    checks that code's router gradient independently: raising --moe-gate-loss-wt from 0 to 0.5 adds
    0.5 x (1/2 for averaging over two MoE layers) x the definition's gradient, and nothing more."""
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    without, _ = router_update_and_balance_gradient(data_dir, 0.0)
    with_balance, balance_gradient = router_update_and_balance_gradient(data_dir, 0.5)
    want = 0.5 * 0.5 * balance_gradient
    assert want.abs().max() > 1e-2 * without.abs().max(), "the balance term should be visible"
    torch.testing.assert_close(with_balance - without, want, rtol=1e-3, atol=1e-4 * float(without.abs().max()))


def error_of_worker(rank, world, data_dir, flag, value_by_rank, build_step):
    """Build (and with ``build_step == "wrap"`` wrap for training) with ``flag`` set per rank;
    return the error message each worker got."""
    argv = training_args(data_dir, world, ["--ddp-backend", "legacy_ddp"])
    argv[argv.index(flag) + 1] = str(value_by_rank[rank])
    try:
        task, trainer = build_trainer(argv)
        if build_step == "wrap":
            trainer.model
    except (RuntimeError, ValueError) as error:
        return str(error)
    return "no error"


def test_shared_weights_that_differ_across_workers_at_start_are_an_error(tmp_path):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    # A rank-dependent seed makes the shared weights differ.
    messages = run_on_workers(error_of_worker, 2, data_dir, "--seed", [10, 11], "wrap")
    assert all("differs between rank 0 and rank 1 before training" in m and "--seed" in m for m in messages), messages


def uneven_batches_worker(rank, world, data_dir):
    task, trainer = build_trainer(training_args(data_dir, world, ["--ddp-backend", "legacy_ddp"]))
    pairs = sentence_pairs(12)
    first = collate(task, pairs[6 * rank : 6 * rank + 6])
    trainer.reset_dummy_batch(first)  # what fairseq's train loop does with the epoch's first batch
    trainer.train_step([first])
    # Second step: this worker's shard ran out (fairseq hands it an empty batch); rank 0 has one more.
    second = collate(task, pairs[:5]) if rank == 0 else {}
    return one_step_on(task, trainer, second)


def one_step_on(task, trainer, sample):
    from fairseq.logging import metrics

    with metrics.aggregate(new_root=True) as agg:
        trainer.train_step([sample])
    return {
        "loss": float(agg["loss"].avg),
        "params": {n: p.detach().clone() for n, p in trainer.get_model().named_parameters()},
        "expert_names": [n for n, p in trainer.get_model().named_parameters() if getattr(p, "expert", False)],
    }


def test_a_worker_whose_shard_ran_out_joins_the_all_to_all_with_a_dummy_batch(tmp_path):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    results = run_on_workers(uneven_batches_worker, 2, data_dir)

    task, trainer = build_trainer(training_args(data_dir, 1))
    pairs = sentence_pairs(12)
    trainer.train_step([collate(task, pairs)])
    reference = one_step_on(task, trainer, collate(task, pairs[:5]))

    assert results[0]["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    experts = set(reference["expert_names"])
    for name, want in reference["params"].items():
        got = torch.cat([r["params"][name] for r in results]) if name in experts else results[1]["params"][name]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


def eval_bleu_worker(rank, world, data_dir, capacity):
    try:
        build_trainer(training_args(data_dir, world, ["--eval-bleu", *capacity]))
        outcome = "no error"
    except ValueError as error:
        outcome = str(error)
    torch.distributed.barrier()  # neither tears the group down while the other still builds its groups
    return outcome


@pytest.mark.parametrize(
    "capacity, refused",
    [
        (["--moe-eval-capacity-factor", "1.0"], "drop --moe-eval-capacity-factor"),
        (["--moe-eval-capacity-token-fraction", "0.5"], "an evaluation capacity of 0.5 of the tokens"),
        (["--moe-eval-capacity-token-fraction", "1.0", "--moe-eval-capacity-factor", "1.0"], None),
    ],
    ids=["factor", "token-fraction-below-1", "token-fraction-of-1"],
)
def test_eval_bleu_with_an_inference_capacity_is_refused_in_expert_parallel_training(tmp_path, capacity, refused):
    """Lock-step generation equals one process only when dropless, the rule of sharded fairseq-generate: a
    token fraction replaces the factor and drops nothing from 1 on (tests/cli/test_sharded_inference_cli.py
    has --eval-bleu itself working on 2 workers)."""
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    messages = run_on_workers(eval_bleu_worker, 2, data_dir, capacity)
    if refused is None:
        assert messages == ["no error", "no error"], messages
    else:
        assert all("--eval-bleu on 2 workers needs dropless inference routing" in m for m in messages), messages
        assert all(refused in m for m in messages), messages
