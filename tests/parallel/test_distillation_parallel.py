"""Distillation on two gloo workers with the teacher's experts spread over them equals one process holding the
whole teacher: each worker runs one real ``Trainer.train_step`` on its share of a batch with ``--criterion
moe_distillation`` and a teacher set saved by 2 workers (``--distill-teacher-experts auto``: each worker holds
2 of its 4 experts, and every teacher forward is an all-to-all between them); one process runs the same step
on the whole batch with the teacher's experts all local. Loss, gradient norm and every updated parameter
(an MoE student's experts by global id) agree, for an MoE student under every backend that trains
(fully_sharded included) and for a dense student. On the workers the criterion, not each layer, sums the
student's balance losses' gradients over them (once per forward, as the other MoE criterions)."""

import pytest
import torch

from support.inputs.distillation import distilled, write_teacher
from support.launch.dist_utils import run_on_workers
from support.launch.in_process_trainer import build_trainer, collate, micro_batches, training_args, write_dictionaries

pytestmark = pytest.mark.slow

DISTILL = ["--distill-weight", "0.6", "--distill-temperature", "2"]
# (backend, dense student, token shares per worker)
CASES = [
    ("legacy_ddp", False, [5, 7]),
    ("no_c10d", False, [8, 4]),
    ("c10d", False, [6, 6]),
    ("pytorch_ddp", False, [3, 9]),
    ("fully_sharded", False, [5, 7]),
    ("legacy_ddp", True, [4, 8]),
    ("fully_sharded", True, [7, 5]),
]


def step(data_dir, teacher, backend, dense, world, pairs):
    """One logged ``Trainer.train_step`` of a distilled student on ``pairs``: loss, grad norm, parameters (whole),
    and the expert rows of the teacher this worker holds."""
    from fairseq.logging import metrics

    from fairseq_moe_ext.criterions import moe_criterions

    argv = distilled(training_args(data_dir, world, ["--ddp-backend", backend]), teacher, *DISTILL, dense=dense)
    task, trainer = build_trainer(argv)
    summed_over, groups = moe_criterions.summed_over, []  # the group each add_moe_losses sums the losses over
    moe_criterions.summed_over = lambda records: groups.append(summed_over(records)) or groups[-1]
    try:
        with metrics.aggregate(new_root=True) as agg:
            trainer.train_step([collate(task, pairs)])
    finally:
        moe_criterions.summed_over = summed_over
    model = trainer.get_model()
    teacher_experts = {p.shape[0] for n, p in trainer.criterion.teacher.named_parameters() if ".experts." in n}
    return {
        "loss": float(agg["loss"].avg),
        "gnorm": float(agg["gnorm"].avg),
        "distill_kl": float(agg["distill_kl"].avg),
        "params": {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()
        },  # fmt: skip
        "experts": [n for n, p in model.named_parameters() if getattr(p, "expert", False)],
        "teacher_experts": sorted(teacher_experts),
        # under fully_sharded only the student is sharded: the teacher keeps plain tensors, none an FSDP2 slice
        "teacher_fsdp": any(hasattr(p, "full_tensor") for p in trainer.criterion.teacher.parameters()),
        "student_fsdp": any(hasattr(p, "full_tensor") for p in model.parameters()),
        "losses_summed_by_criterion": [group is not None for group in groups],
    }


def worker(rank, world, data_dir, teacher):
    results = []
    for backend, dense, shares in CASES:
        (batch,) = micro_batches(shares, 1)
        start = sum(shares[:rank])
        results.append(step(data_dir, teacher, backend, dense, world, batch[start : start + shares[rank]]))
    return results


def test_a_step_with_the_teacher_s_experts_spread_over_two_workers_equals_one_process(tmp_path):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    teacher = write_teacher(data_dir, tmp_path / "teacher" / "checkpoint_last.pt", parallel_size=2)
    assert (tmp_path / "teacher" / "checkpoint_last-rank-1-of-2.pt").is_file()
    by_rank = run_on_workers(worker, 2, data_dir, str(teacher))
    for i, (backend, dense, shares) in enumerate(CASES):
        results = [r[i] for r in by_rank]
        reference = step(data_dir, str(teacher), backend, dense, 1, micro_batches(shares, 1)[0])
        case = f"{backend}, {'dense' if dense else 'MoE'} student"
        assert reference["teacher_experts"] == [4] and all(r["teacher_experts"] == [2] for r in results), case
        assert reference["distill_kl"] > 0, case
        assert not any(r["teacher_fsdp"] for r in results), f"{case}: the teacher was FSDP-wrapped"
        assert all(r["student_fsdp"] == (backend == "fully_sharded") for r in results), case
        summed = [] if dense else [True]  # a dense student has no MoE losses
        assert all(r["losses_summed_by_criterion"] == summed for r in results), f"{case}: summed by each layer"
        for r in results:
            for key in ("loss", "gnorm", "distill_kl"):
                assert r[key] == pytest.approx(reference[key], rel=1e-5), f"{case}: {key}"
        experts = set(reference["experts"])
        assert bool(experts) != dense and experts == set(results[0]["experts"]), case
        for name, want in reference["params"].items():
            if name in experts:
                got = torch.cat([r["params"][name] for r in results])  # by global id
            else:
                assert torch.equal(results[1]["params"][name], results[0]["params"][name]), f"{case}: {name}"
                got = results[0]["params"][name]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"{case}: {name}")
