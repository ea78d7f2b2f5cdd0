"""``--ddp-backend fully_sharded --moe-fully-sharded-experts sharded``: each MoE layer's experts are
sharded over their replica group (the W/P workers holding the same experts), and a training step
through fairseq's Trainer is still the step of one process holding every expert, and legacy_ddp's.

On W = 4 workers with P = 2 (replica groups {0, 2} and {1, 3}) and on W = 2 with P = 1 (one replica
group, the world), each gloo worker takes one fp32 step of two micro-batches (NAG: a wrong scale of
the summed expert gradients shows in the update, a wrong norm in the clipping) and one step in
bf16 and in fp16 (every token to every expert: mixed_precision_steps.py) under fully_sharded (experts
sharded) and under legacy_ddp (experts whole), the fp16
one after a step that an inf in one worker's slice of the experts' gradient made every worker skip;
one process holding everything takes the same steps on the whole batch. The same workers count what
each holds: 1/(W/P) of its experts' parameters, gradients and momentum, and one MoE layer's experts
gathered at a time in forward. On W = 4 an fp32 step with ``--moe-normalize-expert-grad sqrt_world_size``
equals legacy_ddp's.
"""

import pytest
import torch

from support.launch.dist_utils import run_on_workers
from support.launch.in_process_trainer import (
    assert_step_equals_one_process,
    build_trainer,
    micro_batches,
    one_step,
    replicated_case_flags,
    training_args,
    write_dictionaries,
)
from support.launch.mixed_precision_steps import (
    NAG,
    PRECISIONS,
    assert_same_step,
    cpu_shims,
    low_precision_flags,
    run_precision_case,
)

pytestmark = pytest.mark.slow

SHARDED = ["--ddp-backend", "fully_sharded", "--moe-fully-sharded-experts", "sharded"]
# Each low-precision (and sqrt_world_size) step is taken with experts sharded and under legacy_ddp (experts whole).
COMPARED = (("sharded", SHARDED), ("legacy_ddp", ["--ddp-backend", "legacy_ddp"]))
# world: (experts, P, token shares per worker)
CASES = {4: (4, 2, [2, 5, 3, 4]), 2: (4, 1, [5, 7])}
# fp16: the first step has an inf in this rank's slice of the first MoE layer's experts (every worker skips it).
OVERFLOW_RANK = 1
# The fp32 step accumulates two micro-batches (--update-freq 2): the first without a reduce-scatter.
MICRO_BATCHES = 2
# The nllb branch's expert-gradient scale (sqrt(P) times the exact gradient), on W = 4 in fp32.
SQRT_P = ["--moe-normalize-expert-grad", "sqrt_world_size"]


def whole_params(result):
    """Every parameter whole (gathered: a collective each, in the same order on every worker)."""
    result["params"] = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in result["params"].items()}
    return result


def expert_sharding_worker(rank, world, data_dir):
    from fairseq_moe_ext.parallel import fully_sharded

    cpu_shims()
    experts, parallel, shares = CASES[world]
    flags = replicated_case_flags(experts, parallel, NAG)
    task, trainer = build_trainer(training_args(data_dir, world, [*SHARDED, *flags]))
    model = trainer.get_model()
    start = sum(shares[:rank])
    gathered = experts_gathered_in_forward(model)
    fp32 = one_step(task, trainer, *[b[start : start + shares[rank]] for b in micro_batches(shares, MICRO_BATCHES)])
    fp32["held"] = fully_sharded.held_bytes(model, trainer.optimizer.optimizer)
    fp32["experts_sharded"] = [fully_sharded.is_sharded(p) for p in model.parameters() if getattr(p, "expert", False)]
    fp32["saved"] = saved_experts(trainer)
    fp32["gathered"] = gathered
    low = {}
    for precision in ("bf16", "fp16"):
        overflow = OVERFLOW_RANK if precision == "fp16" else None
        low[precision] = {
            backend: run_precision_case(
                data_dir,
                world,
                rank,
                shares,
                [*backend_flags, *flags, *low_precision_flags(precision, experts)],
                overflow,
            )
            for backend, backend_flags in COMPARED
        }
    if world == 4:  # P = 2: sqrt(P) scales the expert gradients, so the sharded path must apply it as legacy_ddp does
        low["sqrt_world_size"] = {
            backend: run_precision_case(data_dir, world, rank, shares, [*backend_flags, *flags, *SQRT_P])
            for backend, backend_flags in COMPARED
        }
    return whole_params(fp32), low


def experts_gathered_in_forward(model):
    """Each time an MoE layer's experts run forward, how many MoE layers' experts are gathered (whole)
    then: the hook runs after FSDP2's own pre-forward hook, which gathered the running layer's."""
    from fairseq_moe_ext.moe.experts import BatchedExperts
    from fairseq_moe_ext.parallel.fully_sharded import is_sharded

    modules = [m for m in model.modules() if isinstance(m, BatchedExperts)]
    counts = []
    for module in modules:
        module.register_forward_pre_hook(
            lambda *_: counts.append(sum(not is_sharded(m.batched_fc1_w) for m in modules))
        )
    return counts


def saved_experts(trainer):
    """What this worker's ``Trainer.state_dict`` (as a save calls it) holds of its experts and of their
    NAG momentum: gathered whole on the worker that writes the rank file, nothing elsewhere."""
    trainer.consolidate_optimizer()
    state = trainer.state_dict()
    names = [n for n, p in trainer.get_model().named_parameters() if getattr(p, "expert", False)]
    slots = state["moe"]["optimizer_expert_slots"]
    momentum = [state["last_optimizer_state"]["state"].get(i, {}).get("momentum_buffer") for i in slots]
    return {"model": {n: state["model"].get(n) for n in names}, "momentum": momentum}


def expert_bytes_held(whole_experts, replicas, replica_index):
    """fp32 bytes of this worker's dim-0 slice (torch.chunk's split) of its E/P experts of each tensor."""
    total = 0
    for local in whole_experts:
        chunk = -(-local.shape[0] // replicas)
        total += max(0, min(chunk, local.shape[0] - replica_index * chunk)) * local[0].numel() * 4
    return total


@pytest.mark.parametrize("world", [4, 2])
def test_experts_sharded_over_replicas_step_like_one_process_and_hold_1_over_w_by_p(tmp_path, monkeypatch, world):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    by_rank = run_on_workers(expert_sharding_worker, world, data_dir)
    experts, parallel, shares = CASES[world]
    replicas = world // parallel
    flags = replicated_case_flags(experts, parallel, NAG)
    fp32 = [r[0] for r in by_rank]
    assert all(all(r["experts_sharded"]) and r["experts_sharded"] for r in fp32), "experts were not sharded"
    # fp32: one process holding every expert, to the oracle's tolerance (loss, norm, every weight).
    assert_step_equals_one_process(fp32, data_dir, shares, flags, MICRO_BATCHES, parallel)
    names = fp32[0]["expert_names"]
    moe_layers = len(names) // 4  # four stacked tensors per MoE layer (two weights, two biases)
    assert all(r["gathered"] == [1] * moe_layers * MICRO_BATCHES for r in fp32), "one MoE layer's experts at a time"
    for rank, r in enumerate(fp32):
        want = expert_bytes_held([r["params"][n] for n in names], replicas, rank // parallel)
        held = r["held"]
        assert held["expert_params"] == held["expert_grads"] == held["expert_optimizer"] == want, (rank, held)
    whole = sum(fp32[0]["params"][n].numel() * 4 for n in names)
    for ep_rank in range(parallel):
        group = [r["held"]["expert_params"] for r in fp32[ep_rank::parallel]]
        assert sum(group) == whole and max(group) * replicas == whole, f"replica group {ep_rank}: {group}"
    # A save: the worker of the first replica (it writes its rank file) holds its E/P experts whole.
    for rank, r in enumerate(fp32):
        for name in names:
            saved = r["saved"]["model"][name]
            if rank < parallel:
                assert type(saved) is torch.Tensor and torch.equal(saved, r["params"][name]), (rank, name)
            else:
                assert saved is None, f"rank {rank} holds a gathered {name} it does not write"
        shapes = [None if m is None else tuple(m.shape) for m in r["saved"]["momentum"]]
        whole_shapes = [tuple(r["params"][n].shape) for n in names]
        assert shapes == (whole_shapes if rank < parallel else [None] * len(names)), (rank, shapes)
    # --moe-normalize-expert-grad sqrt_world_size: the step legacy_ddp takes (sqrt(2) times the exact expert
    # gradient, so not the one-process step), to fp32 rounding of another sum order.
    for rank, (_, low) in enumerate(by_rank):
        if "sqrt_world_size" in low:
            sharded, legacy = low["sqrt_world_size"]["sharded"], low["sqrt_world_size"]["legacy_ddp"]
            assert_same_step(sharded, legacy, 1e-4, f"sqrt_world_size rank {rank} of {world}, against legacy_ddp")
    # bf16 and fp16 (torch's own arithmetic on the CPU): one process and legacy_ddp in the same precision.
    monkeypatch.setattr("torch.Tensor.cuda", lambda self, *args, **kwargs: self)  # cpu_shims, undone after
    for precision in ("bf16", "fp16"):
        tolerance = PRECISIONS[precision][1]
        overflow = 0 if precision == "fp16" else None  # one process: the inf in its only worker
        precision_flags = low_precision_flags(precision, experts)
        reference = run_precision_case(data_dir, 1, 0, [sum(shares)], [*flags, *precision_flags], overflow)
        for rank, (_, low) in enumerate(by_rank):
            sharded, legacy = low[precision]["sharded"], low[precision]["legacy_ddp"]
            what = f"{precision} rank {rank} of {world}"
            assert_same_step(sharded, reference, tolerance, f"{what}, against one process", rank % parallel)
            assert_same_step(sharded, legacy, tolerance, f"{what}, against legacy_ddp")
            assert sharded["loss"] == legacy["loss"], f"{what}: the same forward, {sharded['loss']} vs {legacy['loss']}"
            assert sharded["dtypes"] == ["torch.float32"], f"{what}: the stepped weights are {sharded['dtypes']}"
            assert sharded["held"]["expert_params"] == fp32[rank]["held"]["expert_params"], what
            if overflow is not None:  # the inf in rank 1's slice: every worker skipped and halved its scale
                for run in (sharded, legacy):
                    assert run["updates_after_overflow"] == 0, f"{what}: stepped on an overflow"
                    assert all(run["after_overflow"][n].equal(w) for n, w in run["before"].items()), what
                    assert run["scales"][:2] == [64.0, 32.0], f"{what}: loss scales {run['scales']}"
