"""``plan`` counts a distillation teacher (``--criterion moe_distillation --distill-teacher PATH``): its weights on
a worker are the bytes the criterion's teacher holds there (every expert in one process; half of them with its
experts spread over 2 workers is what test_distillation_parallel.py's workers hold), in the dtype it runs in;
its forward's bound is the most bytes alive at once, counted as tensors are made and freed; a dense student is
planned beside it, and its column adds to every row's total."""

import pytest
import torch

from fairseq_moe_ext.training.teacher_plan import LivePeak, teacher_cost
from support.inputs.distillation import distilled, write_teacher
from support.launch.in_process_trainer import build_trainer, training_args, write_dictionaries


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan_teacher")
    data_dir = str(root / "data")
    write_dictionaries(data_dir)
    return data_dir, write_teacher(data_dir, root / "set" / "checkpoint_last.pt", parallel_size=2)


def test_the_peak_is_the_most_bytes_of_made_tensors_alive_at_once():
    x = torch.empty(1000, device="meta")  # made before: not counted
    with LivePeak(skip=set()) as tracker:
        a = x * 2  # 4000 bytes alive
        b = a + 1  # 8000
        del a  # 4000
        c = b * 3  # 8000
        d = torch.cat([b, c])  # 16000
        del b, c, d  # 0
        e = x.view(10, 100) * 1  # 4000
    assert (tracker.peak, tracker.now) == (16000, 4000), (tracker.peak, tracker.now)
    del e


def plan_args(data_dir, teacher_path, *flags):
    argv = distilled(training_args(data_dir, 1, ["--max-tokens", "64"]), teacher_path, *flags, dense=True)
    del argv[argv.index("--distributed-world-size") : argv.index("--distributed-world-size") + 2]
    return argv


@pytest.mark.parametrize("dtype", ["student", "bfloat16"])
def test_the_teacher_s_weights_on_one_worker_are_what_the_criterion_holds(teacher, dtype):
    from fairseq_moe_ext.training.plan_model import build_task_and_model

    data_dir, path = teacher
    argv = plan_args(data_dir, path, "--distill-teacher-dtype", dtype)
    cfg, _, task, _ = build_task_and_model(argv, None)
    cost = teacher_cost(cfg, task, 1)
    _, trainer = build_trainer([*argv, "--distributed-world-size", "1"])
    held = trainer.criterion.teacher
    want = sum(t.numel() * t.element_size() for t in [*held.parameters(), *held.buffers()])
    assert cost.weights == want and cost.parallel_size == 1
    assert cost.dtype == (torch.float32 if dtype == "student" else torch.bfloat16)
    assert cost.experts == sum(p.numel() for n, p in held.named_parameters() if ".experts." in n) > 0
    spread = teacher_cost(cfg, task, 2)  # the set was saved by 2 workers: auto spreads its experts
    assert spread.parallel_size == 2
    assert spread.weights == want - cost.experts // 2 * held.encoder.embed_tokens.weight.element_size()


def test_plan_prints_a_dense_student_with_its_teacher_s_column_in_every_total(teacher, capsys):
    from fairseq_moe_ext.training.plan_cli import main

    data_dir, path = teacher
    assert main([*plan_args(data_dir, path, "--distill-top-k", "4"), "--world-size", "2"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "none, a dense model" in table[0], table[0]
    assert table[2].startswith(f"teacher {path}: ") and "experts spread over 2 workers" in table[2], table[2]
    assert table[4].split()[-3:] == ["teacher", "total", "fits"], table[4]
    rows = [line.split() for line in table if line.startswith(("legacy_ddp", "fully_sharded"))]
    assert [r[:3] for r in rows] == [["legacy_ddp", "1", "whole"], ["fully_sharded", "1", "whole"]]
    for r in rows:  # experts p/g/opt, shared p/g/opt, master, buffers, activations, teacher -> total
        parts = [float(v) for v in [*r[3].split("/"), *r[4].split("/"), *r[5:9]]]
        assert float(r[8]) > 0 and sum(parts) == pytest.approx(float(r[9]), abs=0.05), r
    dense = plan_args(data_dir, path)
    dense[dense.index("--criterion") + 1] = "moe_label_smoothed_cross_entropy"
    dense = dense[: dense.index("--distill-teacher")]
    assert main([*dense, "--world-size", "2"]) == 2, "a dense model without a teacher is not planned"
    assert "is not an MoE architecture of this plugin" in capsys.readouterr().err
