"""Bad input, round four: every fairseq entry point prints an MoE refusal as one line, ``prog: error:
<message>``, with argparse's exit status 2 and no traceback (the runner fails a case whose output holds
one): fairseq-validate, -eval-lm, -interactive and -hydra-train here, fairseq-train and -generate in
tests/cli/test_bad_input.py; under torchrun one line per worker, naming its rank (a refused flag and a
refusal after the workers connected alike). The excepthook itself: tests/fairseq/test_refusal_excepthook.py.
And every fairseq loader of a user's file (resume from a set, generation, --moe-upcycle-from, the hub
interface) refuses a pickle that would run a shell command, which never runs: were the file unpickled,
the command's marker file would appear in the watched directory (the checkpoint tool's loaders and the
imports: tests/checkpoint/test_untrusted_pickles.py).
"""

import re

import pytest

from support.inputs.bad_input_entry_points import (
    a_set_missing_rank_1,
    forge_rank_1,
    generate_on_two_workers,
    generating_from_a_set_missing_rank_1,
    hydra_training,
    refused_at_setup,
    refused_by,
    the_single_checkpoint,
    two_workers_refused_at_setup,
    upcycling_from_a_forged_dense_checkpoint,
)
from support.inputs.bad_input_makers import fresh_training, generate_from, resume
from support.inputs.untrusted_pickles import MARKER
from support.launch.bad_input_runner import (
    GENERATE,
    LAUNCHED_TRAIN,
    TRAIN,
    Case,
    check_case,
    copy_of,
    fairseq_generate,
    fairseq_train,
    two_workers,
)

pytestmark = pytest.mark.slow
MISSING = "checkpoint_last-rank-1-of-2.pt is missing"
UNPICKLING = "it pickles posix.system, which is not among the types fairseq checkpoints store"
TRUST = "if you trust the file, add the type to fairseq_moe_ext.checkpoint.CHECKPOINT_SAFE_GLOBALS"
RESTORE = "restore the set from a backup, or point --path"
# A set-up refusal (MoESetupError: here the expert matmul asked for by name on a torch without it).
SETUP = "expert matmul 'grouped_mm' needs torch._grouped_mm, which torch"
TORCH_FIX = "use 'auto' or 'loop' (FAIRSEQ_MOE_EXPERT_MATMUL=auto), or torch >= 2.8"

# fmt: off
CASES = [
    # -- the inference tools, on a set that lost a rank file (refused when the checkpoint is read)
    Case("validate-from-a-set-missing-a-rank-file", refused_by("validate"),
         a_set_missing_rank_1("--max-tokens", "500"), "validate.py: error", MISSING, RESTORE),
    Case("eval-lm-from-a-set-missing-a-rank-file", refused_by("eval_lm"), a_set_missing_rank_1(), "eval_lm.py: error",
         MISSING, RESTORE),
    Case("interactive-from-a-set-missing-a-rank-file", refused_by("interactive"), a_set_missing_rank_1(),
         "interactive.py: error", MISSING, RESTORE),
    Case("generate-on-two-workers-from-a-set-missing-a-rank-file", generate_on_two_workers,
         generating_from_a_set_missing_rank_1(), "fairseq-generate: error", MISSING, RESTORE),
    # -- hydra-train: the model's options are checked when it is built (hydra prints its own line first)
    Case("hydra-train-top-k-above-expert-count", refused_by("hydra_train"), hydra_training("model.moe_top_k=5"),
         "hydra_train.py: error", "--moe-top-k 5 exceeds --moe-expert-count 4", "use --moe-top-k <= 4"),
    Case("hydra-train-experts-sharded-under-legacy-ddp", refused_by("hydra_train"),
         hydra_training("+model.moe_fully_sharded_experts=sharded", "distributed_training.ddp_backend=legacy_ddp"),
         "hydra_train.py: error", "--moe-fully-sharded-experts sharded shards each MoE layer's experts",
         "and this run has --ddp-backend legacy_ddp, which would ignore it: add --ddp-backend fully_sharded"),
    # -- torchrun: one line per worker, naming its rank, for a refused flag and once the workers are connected
    Case("refused-flag-on-two-workers", two_workers, fresh_training("--moe-top-k", "5"), LAUNCHED_TRAIN,
         "--moe-top-k 5 exceeds --moe-expert-count 4", "use --moe-top-k <= 4"),
    Case("refusal-on-two-connected-workers", two_workers, fresh_training("--moe-expert-parallel-size", "3"),
         LAUNCHED_TRAIN, "of 2: --moe-expert-parallel-size 3 does not divide the 2 workers", "use a P dividing"),
    # -- a set-up refusal (MoESetupError, not an option's), through every entry point: one line, status 2
    Case("train-on-a-torch-without-the-matmul-asked-for", refused_at_setup("train"), fresh_training(), TRAIN, SETUP,
         TORCH_FIX),
    Case("generate-on-a-torch-without-the-matmul-asked-for", refused_at_setup("generate"),
         the_single_checkpoint("--beam", "2"), GENERATE, SETUP, TORCH_FIX),
    Case("validate-on-a-torch-without-the-matmul-asked-for", refused_at_setup("validate"),
         the_single_checkpoint("--max-tokens", "500"), "validate.py: error", SETUP, TORCH_FIX),
    Case("eval-lm-on-a-torch-without-the-matmul-asked-for", refused_at_setup("eval_lm"), the_single_checkpoint(),
         "eval_lm.py: error", SETUP, TORCH_FIX),
    Case("interactive-on-a-torch-without-the-matmul-asked-for", refused_at_setup("interactive"),
         the_single_checkpoint(), "interactive.py: error", SETUP, TORCH_FIX),
    Case("hydra-train-on-a-torch-without-the-matmul-asked-for", refused_at_setup("hydra_train"), hydra_training(),
         "hydra_train.py: error", SETUP, TORCH_FIX),
    Case("two-workers-on-a-torch-without-the-matmul-asked-for", two_workers_refused_at_setup, fresh_training(),
         "train.py: error", "of 2: " + SETUP, TORCH_FIX),
    # -- several workers asked of one CPU process: fairseq's AssertionError becomes the way to start them
    Case("two-workers-on-cpu-without-a-launcher", fairseq_train, fresh_training("--distributed-world-size", "2"),
         TRAIN, "--distributed-world-size 2 with 0 CUDA devices: fairseq starts workers itself only on GPUs",
         "start 2 CPU workers with torchrun --nproc_per_node 2 $(which fairseq-train) ... --distributed-world-size 2"),
    # -- a file whose pickle would run a shell command (a file in the watched directory): refused by every
    # fairseq loader (the checkpoint tool's and the imports': tests/checkpoint/test_untrusted_pickles.py)
    Case("resume-from-a-set-whose-rank-file-pickles-a-shell-command", fairseq_train,
         resume(damage=forge_rank_1, source="set"), TRAIN, UNPICKLING, TRUST),
    Case("generate-from-a-set-whose-rank-file-pickles-a-shell-command", fairseq_generate,
         generate_from("set", forge_rank_1), GENERATE, UNPICKLING, TRUST),
    Case("train-upcycled-from-a-dense-checkpoint-pickling-a-shell-command", fairseq_train,
         upcycling_from_a_forged_dense_checkpoint(), TRAIN, UNPICKLING, TRUST),
]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input_fails_in_one_line_naming_problem_and_fix_and_changes_no_file(case, started):
    check_case(case, started[case.id])


def test_a_refused_flag_on_two_workers_is_one_line_per_worker_naming_its_rank(started):
    """The first worker to stop says it (torchrun stops the others, which may not get to)."""
    output = started["refused-flag-on-two-workers"].future.result()
    lines = re.findall(r"^fairseq-train: error: rank (\d) of 2: --moe-top-k 5 exceeds", output, flags=re.M)
    assert lines and len(lines) == len(set(lines)) and set(lines) <= {"0", "1"}, output[-3000:]


def test_a_refusal_of_connected_workers_names_the_rank_of_each_line(started):
    output = started["refusal-on-two-connected-workers"].future.result()
    lines = re.findall(r"^fairseq-train: error: rank (\d) of 2: --moe-expert-parallel-size 3", output, flags=re.M)
    assert lines and set(lines) <= {"0", "1"}, output[-3000:]


def test_the_hub_interface_refuses_a_set_whose_rank_file_pickles_a_shell_command(checkpoints, tmp_path):
    from fairseq_moe_ext.checkpoint import UnsafeCheckpointError
    from fairseq_moe_ext.models.moe_transformer import MoETransformerModel

    inputs = checkpoints.result()
    directory = copy_of(inputs.set, tmp_path)
    forge_rank_1(directory)
    with pytest.raises(UnsafeCheckpointError, match=re.escape(UNPICKLING)):
        MoETransformerModel.from_pretrained(
            str(directory), checkpoint_file="checkpoint_last.pt", data_name_or_path=str(inputs.data)
        )
    assert not (directory / MARKER).exists(), "the pickled command ran"
