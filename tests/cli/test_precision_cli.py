"""Mixed-precision flags exactly as fairseq users type them, through the real command-line tools.

What runs on a CPU-only torch: --bf16, --memory-efficient-bf16, --memory-efficient-fp16 and
--fp16 with per-parameter gradients (which this plugin picks for multi-worker MoE runs). fairseq's
flattened --fp16 asks torch.cuda for its buffer's device and --amp's GradScaler disables itself
without CUDA, so those two are checked on GPUs (benchmarks/gpu_oneshot.sh).
"""

import pytest
import torch

from support.launch.fairseq_helpers import (
    assert_loss_falls,
    assert_shared_identical_experts_distinct_norms_equal,
    load_rank_probes,
    run_fairseq,
    torchrun,
)
from support.launch.multiworker_cli_runs import moe_args
from support.launch.paths import PROBES


def parsed(*flags):
    from fairseq import options

    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, ["data-bin", "--arch", "transformer", *flags])


@pytest.mark.parametrize(
    "flags, bf16",
    [
        ([], False),
        (["--bf16"], True),
        (["--memory-efficient-bf16"], True),
        (["--bf16", "--cpu"], True),
    ],
    ids=["fp32", "bf16", "memory-efficient-bf16", "bf16-cpu"],
)
def test_bf16_trains_on_cuda_or_cpu_and_never_turns_on_tpu_by_itself(flags, bf16):
    args = parsed(*flags)
    assert (args.tpu, args.bf16) == (False, bf16)


def test_an_explicit_tpu_flag_without_torch_xla_is_refused_in_one_line():
    import importlib.util

    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch_xla is installed here: --tpu is honoured")
    with pytest.raises(ValueError) as error:
        parsed("--bf16", "--tpu")
    message = str(error.value)
    assert "\n" not in message and message.startswith("--tpu needs torch_xla") and "drop --tpu" in message


@pytest.mark.slow
def test_bf16_training_through_fairseq_train_on_one_cpu_worker_learns(data, tmp_path):
    output = run_fairseq("train", *moe_args(data, tmp_path / "ck", 20, "--bf16", "--no-epoch-checkpoints"), timeout=240)
    assert_loss_falls(output)
    assert "not on a TPU" in output  # (checkpoints cannot tell: fairseq saves bf16 weights as fp32)


# Per flag: the optimizer fairseq must build on every worker, and the weights' dtype.
# fmt: off
MULTI_WORKER = {
    "--bf16": ("FP16Optimizer", torch.bfloat16),
    "--memory-efficient-bf16": ("MemoryEfficientFP16Optimizer", torch.bfloat16),
    "--fp16": ("FP16Optimizer", torch.float16),  # fairseq's default flattens; experts need their marker
}
# fmt: on


@pytest.mark.slow
@pytest.mark.parametrize("flag", list(MULTI_WORKER))
def test_two_worker_mixed_precision_fairseq_train_learns_and_keeps_shared_weights_equal(data, tmp_path, flag):
    probe = tmp_path / "probe"
    args = moe_args(data, tmp_path / "ck", 12, "--ddp-backend", "legacy_ddp", "--no-save", flag)
    output = torchrun(2, PROBES / "fairseq_rank_probe.py", [probe, *args], timeout=300)
    assert_loss_falls(output)
    ranks = load_rank_probes(probe, 2)
    assert_shared_identical_experts_distinct_norms_equal(ranks, updates=12)
    optimizer, dtype = MULTI_WORKER[flag]
    for rank in ranks:
        assert {t.dtype for t in rank["model"].values() if t.is_floating_point()} == {dtype}
        facts = rank["optimizer"]
        assert facts["type"] == optimizer and not facts["flat"], facts
        assert facts["expert_marked"] == len(ranks[0]["expert_keys"]), facts
    if flag == "--fp16":
        assert "fp16 gradients are kept per parameter" in output
