"""``fairseq-train --criterion moe_distillation --distill-teacher SET`` from the command line, with a teacher
set saved by two torchrun workers: a dense student in one process (the teacher merged into it), and students
on two workers with the teacher's experts spread over them under every backend that trains; the student's
checkpoints hold the student alone, and a resume reads the teacher again from its path."""

import pytest
import torch

from support.launch.bad_input_runner import TINY_SHAPE
from support.launch.fairseq_helpers import json_logs, run_fairseq, torchrun
from support.launch.multiworker_cli_runs import BIN, moe_args

pytestmark = pytest.mark.slow

SPREAD = "its experts spread over 2 workers"


@pytest.fixture(scope="module")
def teacher(data, tmp_path_factory):
    """A 2-worker MoE run's set (checkpoint_last-rank-{0,1}-of-2.pt and its manifest)."""
    root = tmp_path_factory.mktemp("teacher")
    torchrun(2, BIN / "fairseq-train", moe_args(data, root / "ck", 6, "--seed", "3"))
    assert (root / "ck" / "checkpoint_last-rank-1-of-2.pt").is_file()
    return root / "ck" / "checkpoint_last.pt"


def student(data, save_dir, max_update, teacher, *extra, dense=False):
    args = moe_args(data, save_dir, max_update, "--distill-teacher", str(teacher), "--distill-weight", "0.5", *extra)
    args[args.index("--criterion") + 1] = "moe_distillation"
    if dense:
        args[args.index("--arch") + 1] = "transformer"
        del args[args.index("--moe-expert-count") : args.index("--moe-expert-count") + 2]
        args += TINY_SHAPE
    return args


def test_a_dense_student_distils_from_a_per_rank_set_in_one_process_and_resumes(data, teacher, tmp_path):
    save = tmp_path / "student"
    output = run_fairseq("train", *student(data, save, 3, teacher, dense=True))
    assert "distillation teacher" in output and "held whole by each worker" in output, output[-3000:]
    logs = json_logs(output)
    assert logs and all(float(r["distill_kl"]) > 0 for r in logs)
    state = torch.load(save / "checkpoint_last.pt", weights_only=False)
    assert not any("expert" in key or key.startswith("teacher") for key in state["model"])
    assert state.get("criterion") is None and state["cfg"]["criterion"]["distill_teacher"] == str(teacher)
    resumed = run_fairseq("train", *student(data, save, 5, teacher, dense=True))
    assert "distillation teacher" in resumed, "a resume reads the teacher again from its path"
    assert [int(r["num_updates"]) for r in json_logs(resumed)] == [4, 5]


# fmt: off
@pytest.mark.parametrize("backend, dense", [
    ("legacy_ddp", False), ("no_c10d", False), ("c10d", False), ("pytorch_ddp", False), ("fully_sharded", False),
    ("legacy_ddp", True), ("fully_sharded", True),
], ids=lambda v: v if isinstance(v, str) else ("dense" if v else "moe"))
# fmt: on
def test_two_workers_distil_with_the_teacher_s_experts_spread_over_them(data, teacher, tmp_path, backend, dense):
    save = tmp_path / "student"
    output = torchrun(2, BIN / "fairseq-train", student(data, save, 3, teacher, "--ddp-backend", backend, dense=dense))
    assert SPREAD in output, output[-3000:]  # each worker holds 2 of the teacher's 4 experts (rank 0 logs it)
    logs = json_logs(output)
    assert logs and all(float(r["distill_kl"]) > 0 for r in logs)
    saved = sorted(p.name for p in save.iterdir() if p.name.startswith("checkpoint_last"))
    if dense:
        assert saved == ["checkpoint_last.pt"], saved
        keys = torch.load(save / "checkpoint_last.pt", weights_only=False)["model"]
    else:
        assert "checkpoint_last.set.json" in saved, saved
        keys = torch.load(save / "checkpoint_last-rank-0-of-2.pt", weights_only=False)["model"]
    assert keys and not any(key.startswith("teacher") for key in keys)
    if backend == "legacy_ddp" and not dense:  # the resume policy knows the distillation options
        resumed = torchrun(2, BIN / "fairseq-train", student(data, save, 4, teacher, "--ddp-backend", backend, "--distill-weight", "0.8"))
        assert SPREAD in resumed and [int(r["num_updates"]) for r in json_logs(resumed)] == [4]
        assert "was trained with --distill-weight 0.5 and this run has --distill-weight 0.8" in resumed
