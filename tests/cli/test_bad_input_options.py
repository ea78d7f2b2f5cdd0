"""Bad input, round three: numeric options outside what holds them, resumes that would change what the
saved weights compute, --moe-upcycle-from given a set or skipped for a checkpoint it cannot load,
a tool's output under a regular file, and ``python -m fairseq_moe_ext plan``'s own flags. The same table-driven runner as tests/cli/test_bad_input.py (each
case through the real command line: a non-zero exit, one last line naming the problem and the fix,
no file changed or added); a full disk is tests/cli/test_disk_full.py (it needs a filesystem mounted to
fill up). The resume policy's every row, in process: tests/fairseq/test_resume_policy.py; every numeric
option against every kind of bad value: tests/fairseq/test_option_ranges.py.
"""

import re

import pytest

from support.inputs.bad_input_makers import (
    checkpoint_tool_on,
    fresh_lm_training,
    fresh_training,
    import_release_lookalike,
    resume,
)
from support.launch.bad_input_runner import (
    TRAIN,
    Case,
    check_case,
    checkpoint_tool,
    copy_of,
    fairseq_train,
    plan_tool,
    train_args,
)
from support.launch.fairseq_helpers import run_fairseq

pytestmark = pytest.mark.slow
FUNCTION_FIX = "or use a new --save-dir, or add --moe-allow-function-change to train on from these weights"


def training_upcycled_from(source: str, into: str = "new") -> object:
    """fairseq-train --moe-upcycle-from <source's checkpoint_last.pt> --moe-normalize-gate, into a new
    save dir or (``into="dense"``) a copy of the dense run's save dir."""

    def make(inputs, work):
        save_dir = copy_of(inputs.dense, work) if into == "dense" else work / "ck"
        named = (
            work / "missing" / "checkpoint_last.pt"
            if source == "missing"
            else getattr(inputs, source) / "checkpoint_last.pt"
        )
        args = train_args(
            inputs.data, save_dir, "--max-update", "2", "--moe-normalize-gate", "--moe-upcycle-from", str(named)
        )
        return args, [save_dir, getattr(inputs, source) if source != "missing" else work]

    return make


def merge_under_a_regular_file(inputs, work):
    source = copy_of(inputs.set, work, "in")
    (work / "notes.txt").write_text("a file, not a directory")
    return ["merge", source / "checkpoint_last.pt", work / "notes.txt" / "checkpoint_last.pt"], [source, work]


def planning(*flags, data=True):
    """``python -m fairseq_moe_ext plan`` with fairseq-train's arguments for the tiny model, and ``flags``;
    without ``data`` DATA names a directory that does not exist."""

    def make(inputs, work):
        return train_args(inputs.data if data else work / "no-data", work / "ck", *flags), [work]

    make.needs_checkpoints = False
    return make


# fmt: off
CASES = [
    # -- python -m fairseq_moe_ext plan: its own flags, and what it cannot plan
    Case("plan-without-a-world-size", plan_tool, planning(), "plan: error",
         "plan needs --world-size W, the number of GPUs", "e.g. --world-size 8"),
    Case("plan-with-a-memory-that-is-no-size", plan_tool, planning("--world-size", "2", "--device-memory", "80gigs"),
         "plan: error", "--device-memory '80gigs' is not a size", "e.g. 80GiB, 80GB or 141GB"),
    Case("plan-memory-efficient-fp16-with-sgd", plan_tool,
         planning("--world-size", "2", "--memory-efficient-fp16", "--optimizer", "sgd"), "plan: error",
         "--memory-efficient-fp16 needs an optimizer that keeps fp32 state", "use --optimizer adam"),
    Case("plan-an-unknown-architecture", plan_tool, planning("--world-size", "2", "--arch", "moe_transformer_xl"),
         "plan: error", "fairseq-train refused these arguments (argument --arch/-a: invalid choice: "
         "'moe_transformer_xl'", "fix the argument it names"),
    Case("plan-a-dense-architecture", plan_tool, planning("--world-size", "2", "--arch", "transformer"),
         "plan: error", "--arch transformer is not an MoE architecture of this plugin",
         "plan is for moe_transformer* and moe_transformer_lm* models"),
    Case("plan-with-a-dictionary-beyond-any-vocabulary", plan_tool,
         planning("--world-size", "2", "--dictionary-size", "256206000", data=False), "plan: error",
         "--dictionary-size 256206000 is beyond 4 x the largest vocabulary of a released model (NLLB-200's 256,206 "
         "symbols) (at most 1048576)", "give the dictionary's size"),
    Case("plan-with-a-dictionary-smaller-than-its-specials", plan_tool,
         planning("--world-size", "2", "--dictionary-size", "3", data=False), "plan: error",
         "--dictionary-size must be an integer >= 5 (fairseq's 4 special symbols and a word), got 3",
         "give the dictionary's size"),
    Case("plan-a-translation-by-dictionary-size-without-a-language-pair", plan_tool,
         planning("--world-size", "2", "--dictionary-size", "30", data=False), "plan: error",
         "no-data: the translation task reads the language pair from the data directory's file names",
         "add --source-lang and --target-lang"),
    Case("plan-for-a-world-beyond-any-job", plan_tool, planning("--world-size", "10000000"), "plan: error",
         "--world-size 10000000 is beyond 10 x the largest training jobs run", "give the number of GPUs"),
    Case("plan-for-a-world-of-no-workers", plan_tool, planning("--world-size", "0"), "plan: error",
         "--world-size must be a positive integer, got 0", "give the number of GPUs"),
    Case("plan-with-an-infinite-memory", plan_tool, planning("--world-size", "2", "--device-memory", "infGB"),
         "plan: error", "--device-memory 'infGB' is not a size", "e.g. 80GiB, 80GB or 141GB"),
    Case("plan-with-a-memory-beyond-any-device", plan_tool, planning("--world-size", "2", "--device-memory", "80TB"),
         "plan: error", "--device-memory '80TB' is beyond 4 x the largest accelerator's memory", "e.g. 80GB"),
    # -- an option of one backend under another, which would ignore it
    Case("experts-sharded-under-legacy-ddp", fairseq_train,
         fresh_training("--ddp-backend", "legacy_ddp", "--moe-fully-sharded-experts", "sharded"), TRAIN,
         "--moe-fully-sharded-experts sharded shards each MoE layer's experts over the workers holding the same ones "
         "under --ddp-backend fully_sharded only, and this run has --ddp-backend legacy_ddp, which would ignore it",
         "add --ddp-backend fully_sharded, or drop --moe-fully-sharded-experts"),
    Case("language-model-experts-sharded-under-c10d", fairseq_train,
         fresh_lm_training("--ddp-backend", "c10d", "--moe-fully-sharded-experts", "sharded"), TRAIN,
         "--moe-fully-sharded-experts sharded shards each MoE layer's experts", "and this run has --ddp-backend c10d"),
    Case("one-fully-sharded-unit-under-the-default-backend", fairseq_train,
         fresh_training("--moe-fully-sharded-unit", "model"), TRAIN,
         "--moe-fully-sharded-unit model makes the whole shared part one FSDP2 unit under --ddp-backend fully_sharded "
         "only, and this run has --ddp-backend pytorch_ddp", "add --ddp-backend fully_sharded, or drop "
         "--moe-fully-sharded-unit"),
    # -- numeric options outside the range of what holds them (every option: tests/fairseq/test_option_ranges.py)
    Case("bias-update-rate-beyond-fp32", fairseq_train,
         fresh_training("--moe-balance", "bias", "--moe-bias-update-rate", "1e39"), TRAIN,
         "--moe-bias-update-rate 1e+39 is more than the fp32 balance bias it moves can hold (at most 3.40282e+38)",
         "use e.g. 0.001"),
    Case("comm-timeout-beyond-a-timedelta", fairseq_train, fresh_training("--moe-comm-timeout", "1e39"), TRAIN,
         "--moe-comm-timeout 1e+39 is more than a timedelta (torch's process-group timeout) can hold (at most "
         "8.64e+13)", "use e.g. 600"),
    Case("gate-loss-weight-beyond-fp32", fairseq_train, fresh_training("--moe-gate-loss-wt", "1e39"), TRAIN,
         "--moe-gate-loss-wt 1e+39 is more than the fp32 loss it multiplies can hold", "use e.g. 0.01 (the default)"),
    # -- resumes that would change what the saved weights compute (every row: tests/fairseq/test_resume_policy.py)
    Case("resume-with-the-sigmoid-router", fairseq_train, resume("--moe-router", "sigmoid"), TRAIN,
         "was trained with --moe-router top and this run has --moe-router sigmoid, which changes what the saved "
         "weights compute", "resume with --moe-router top, " + FUNCTION_FIX),
    Case("resume-with-another-top-k", fairseq_train, resume("--moe-top-k", "1"), TRAIN,
         "was trained with --moe-top-k 2 and this run has --moe-top-k 1, which changes what the saved weights compute",
         "resume with --moe-top-k 2, " + FUNCTION_FIX),
    Case("resume-with-gates-normalised", fairseq_train, resume("--moe-normalize-gate"), TRAIN,
         "was trained with no --moe-normalize-gate and this run has --moe-normalize-gate, which changes what the "
         "saved weights compute", "resume without --moe-normalize-gate, " + FUNCTION_FIX),
    Case("resume-with-another-activation", fairseq_train, resume("--activation-fn", "gelu"), TRAIN,
         "was trained with --activation-fn relu and this run has --activation-fn gelu, which changes what the saved "
         "weights compute", "resume with --activation-fn relu, " + FUNCTION_FIX),
    Case("resume-a-dense-checkpoint-as-an-moe", fairseq_train, resume(source="dense"), TRAIN,
         "checkpoint_last.pt is a dense fairseq checkpoint (no MoE layers), which this MoE model cannot load",
         "start an MoE from it with --moe-upcycle-from"),
    # -- --moe-upcycle-from resolves names as the other tools do, and says when it was skipped
    Case("train-upcycled-from-a-sets-plain-name", fairseq_train, training_upcycled_from("set"), TRAIN,
         "checkpoint_last.pt is already an MoE checkpoint (a set of per-rank files)",
         "upcycling starts from a dense fairseq checkpoint; train on from this one with --restore-file"),
    Case("train-upcycled-from-a-missing-checkpoint", fairseq_train, training_upcycled_from("missing"), TRAIN,
         "no checkpoint named", "pass the dense checkpoint's file"),
    Case("train-upcycled-into-a-save-dir-holding-a-dense-checkpoint", fairseq_train,
         training_upcycled_from("dense", into="dense"), TRAIN,
         "checkpoint_last.pt was skipped because --save-dir", "to upcycle, give this run a new --save-dir"),
    # -- the checkpoint tool's output path
    Case("merge-into-a-path-under-a-regular-file", checkpoint_tool, merge_under_a_regular_file, "error",
         "notes.txt is a file, not a directory", "choose an output name inside a directory"),
    # -- the language list of an NLLB import (NLLB's langs.txt is one comma line; one code per line works too)
    Case("import-with-an-empty-language-list", checkpoint_tool, import_release_lookalike(" ,\n"), "error",
         "langs.txt: no language in it", "pass the language list the model was trained with"),
    Case("import-with-a-language-list-in-latin-1", checkpoint_tool,
         import_release_lookalike("eng_Latn,fra_Latn\n# fran\u00e7ais\n".encode("latin-1")), "error",
         "langs.txt is not UTF-8 text (byte 0xe7 on line 2)", "save it as UTF-8"),
    Case("reshard-to-a-world-beyond-any-job", checkpoint_tool, checkpoint_tool_on("reshard", "--world-size", str(10**12)),
         "error", "--world-size 1000000000000 is beyond 10 x the largest training jobs run (some 100,000 GPUs) (at most "
         "1048576)", "use the number of workers that will resume from the set"),
    Case("import-with-a-language-listed-twice", checkpoint_tool,
         import_release_lookalike("eng_Latn,fra_Latn\ndeu_Latn,eng_Latn\n"), "error",
         "eng_Latn is listed twice (codes 1 and 4)", "pass the list the model was trained with, each code once"),
]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input_fails_in_one_line_naming_problem_and_fix_and_changes_no_file(case, started):
    check_case(case, started[case.id])


def test_the_skipped_upcycle_names_the_checkpoint_it_found_and_why_it_cannot_load(started):
    """The whole line of the skipped --moe-upcycle-from: why it was skipped, and the loader's reason."""
    run = started["train-upcycled-into-a-save-dir-holding-a-dense-checkpoint"]
    output = run.future.result()
    assert re.search(
        r"train\.py: error: --moe-upcycle-from \S+/checkpoint_last\.pt was skipped because --save-dir (\S+) "
        r"already holds \1/checkpoint_last\.pt \(a restarted run resumes its own checkpoint\), and this "
        r"model cannot load that one \(\1/checkpoint_last\.pt is a dense fairseq checkpoint \(no MoE "
        r"layers\), which this MoE model cannot load\): to upcycle, give this run a new --save-dir$",
        output,
        flags=re.M,
    ), output[-3000:]


def test_a_resume_changing_free_options_and_an_overridden_top_k_trains_logging_each(checkpoints, tmp_path):
    inputs = checkpoints.result()
    save_dir = copy_of(inputs.single, tmp_path)
    output = run_fairseq(
        "train",
        *train_args(
            inputs.data,
            save_dir,
            "--max-update",
            "4",
            "--moe-eval-capacity-factor",
            "1.0",
            "--moe-comm-timeout",
            "900",
            "--moe-gate-loss-wt",
            "0.1",
            "--moe-top-k",
            "1",
            "--moe-allow-function-change",
        ),
        timeout=300,
    )
    for logged in (
        "resuming: {} was trained with --moe-eval-capacity-factor 0.0 and this run has --moe-eval-capacity-factor 1.0",
        "resuming: {} was trained with --moe-comm-timeout 600.0 and this run has --moe-comm-timeout 900.0",
        "resuming: {} was trained with --moe-gate-loss-wt 0.01 and this run has --moe-gate-loss-wt 0.1",
        "WARNING | fairseq_moe_ext.training.resume_policy | --moe-allow-function-change: {} was trained "
        "with --moe-top-k 2 and this run has --moe-top-k 1, which changes what the saved weights compute",
    ):
        assert logged.format(save_dir / "checkpoint_last.pt") in output, logged
    assert re.search(r"num_updates 4\b", output), output[-3000:]
