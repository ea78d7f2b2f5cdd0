"""``--ddp-backend fully_sharded`` with ``--bf16``, ``--fp16`` and ``--amp`` through fairseq's Trainer.

Each gloo worker runs real ``Trainer.train_step``s under fully_sharded and under legacy_ddp in the
same precision; one process holding everything runs the same steps on the whole batch. bf16 and
fp16 are torch's own arithmetic on the CPU (``--amp`` is fp32 there, with torch's CPU GradScaler).
The fp16 and amp cases first take a step with an inf in one worker's expert gradient: every worker
must skip it and lower its loss scale alike, then take the same clean step as the others. The
fully_sharded workers hold fp32 master shards (1/W of the shared parameters, gradients and NAG's
momentum each) and fp32 experts. Every token goes to every expert and the steps are compared within a few
unit roundoffs of the precision (mixed_precision_steps.py: why), so that the comparison holds whatever the
CPU's low-precision kernels (docs/testing.md: running the suite as on a CPU without native bf16).
"""

import pytest

from support.launch.dist_utils import run_on_workers
from support.launch.in_process_trainer import replicated_case_flags, write_dictionaries
from support.launch.mixed_precision_steps import (
    NAG,
    PRECISIONS,
    assert_same_step,
    cpu_shims,
    low_precision_flags,
    run_precision_case,
)

pytestmark = pytest.mark.slow

# (precision, experts, P or None for W, token shares per worker); NAG in every case.
# fmt: off
CASES = {
    2: [("bf16", 4, None, [5, 7]), ("fp16", 4, 1, [6, 6]), ("amp", 4, None, [7, 5])],
    4: [("bf16", 4, 2, [2, 5, 3, 4]), ("fp16", 4, None, [3, 3, 4, 2])],
}
# fmt: on
OVERFLOW_RANK = 1


def case_flags(precision, experts, parallel):
    return [*replicated_case_flags(experts, parallel, NAG), *low_precision_flags(precision, experts)]


def precision_cases_worker(rank, world, data_dir):
    cpu_shims()
    results = []
    for precision, experts, parallel, shares in CASES[world]:
        overflow = OVERFLOW_RANK if precision != "bf16" else None
        by_backend = {}
        for backend in ("fully_sharded", "legacy_ddp"):
            flags = ["--ddp-backend", backend, *case_flags(precision, experts, parallel)]
            by_backend[backend] = run_precision_case(data_dir, world, rank, shares, flags, overflow)
        results.append(by_backend)
    return results


def shared_bytes(result, world, rank):
    """fp32 bytes of this rank's dim-0 slice of every shared parameter (torch.chunk's split)."""
    total = 0
    for name, whole in result["before"].items():
        if name not in result["expert_names"]:
            chunk = -(-whole.shape[0] // world)
            total += max(0, min(chunk, whole.shape[0] - rank * chunk)) * whole[0].numel() * 4
    return total


@pytest.mark.parametrize("world", [2, 4])
def test_fully_sharded_bf16_fp16_and_amp_steps_equal_one_process_and_legacy_ddp(tmp_path, monkeypatch, world):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    by_rank = run_on_workers(precision_cases_worker, world, data_dir)
    monkeypatch.setattr("torch.Tensor.cuda", lambda self, *args, **kwargs: self)  # cpu_shims, undone after
    for i, (precision, experts, parallel, shares) in enumerate(CASES[world]):
        tolerance = PRECISIONS[precision][1]
        overflow = 0 if precision != "bf16" else None  # one process: the inf in its only worker
        reference = run_precision_case(
            data_dir, 1, 0, [sum(shares)], case_flags(precision, experts, parallel), overflow
        )
        parallel_size = parallel or min(world, experts)
        for rank, results in enumerate(r[i] for r in by_rank):
            sharded, legacy = results["fully_sharded"], results["legacy_ddp"]
            what = f"{precision} rank {rank} of {world}"
            assert_same_step(sharded, reference, tolerance, f"{what}, against one process", rank % parallel_size)
            assert_same_step(sharded, legacy, tolerance, f"{what}, against legacy_ddp")
            # The same low-precision weights and inputs: the forward is the same bit for bit (fp32
            # arithmetic would not give legacy_ddp's low-precision loss).
            assert sharded["loss"] == legacy["loss"], f"{what}: {sharded['loss']} vs {legacy['loss']}"
            assert sharded["dtypes"] == ["torch.float32"], f"{what}: the stepped weights are {sharded['dtypes']}"
            held, want = sharded["held"], shared_bytes(sharded, world, rank)
            assert held["shared_params"] == held["shared_grads"] == held["shared_optimizer"] == want, (what, held)
            experts_bytes = sum(sharded["after"][n].numel() * 4 for n in sharded["expert_names"])
            assert held["expert_params"] == held["expert_grads"] == experts_bytes, (what, held)
            if precision != "bf16":
                for run in (sharded, legacy):
                    assert run["updates_after_overflow"] == 0, f"{what}: stepped on an overflow"
                    assert all(run["after_overflow"][n].equal(w) for n, w in run["before"].items()), what
                    assert run["scales"][:2] == [64.0, 32.0], f"{what}: loss scales {run['scales']}"
                assert reference["scales"][:2] == [64.0, 32.0]
        whole = sum(
            w.numel() * 4
            for n, w in by_rank[0][i]["fully_sharded"]["before"].items()
            if n not in by_rank[0][i]["fully_sharded"]["expert_names"]
        )
        assert sum(r[i]["fully_sharded"]["held"]["shared_params"] for r in by_rank) == whole
