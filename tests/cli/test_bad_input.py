"""Bad input fails fast with one clear line naming the problem and the fix, and changes no file.

Every case runs a real command-line tool (fairseq-train, fairseq-generate, fairseq-train on two
torchrun workers, ``python -m fairseq_moe_ext.checkpoint``) on inputs made for it and checks that
the run fails, that its last error line names the problem and the fix, and that no file in the
directories it was given (save dir, checkpoint dir, output dir) changed, disappeared or appeared.

Each run spends most of its few seconds importing fairseq, and the runs do not depend on each
other, so they go two at a time (one per core) in the background as soon as their inputs exist;
each test then waits for its own run. ``-k`` selects cases as usual: only selected cases run.
"""

import re

import pytest
import torch

from support.inputs.bad_input_makers import (
    Smuggled,
    checkpoint_tool_on,
    drop_the_ffn_blocks,
    flip_bytes_in_the_middle,
    fresh_lm_training,
    fresh_training,
    generate_args,
    generate_from,
    keep_only_rank_1,
    leave_a_rank_file_of_a_4_worker_save,
    list_rank_1_from_another_directory,
    lock_held_by_this_test_runner,
    locked_fresh_save_dir,
    pickle_a_disallowed_type,
    rename_rank_1_to_a_plain_name,
    replace_rank_1_with_another_runs,
    restore_file_naming_a_damaged_set,
    resume,
    tool_on_copy,
    training_upcycled_from_the_dense_model,
    truncate,
    upcycle,
    with_inputs,
)
from support.launch.bad_input_runner import (
    GENERATE,
    LAUNCHED_TRAIN,
    OOM_PROBE,
    TRAIN,
    Case,
    check_case,
    checkpoint_tool,
    copy_of,
    fairseq_generate,
    fairseq_train,
    two_workers,
    two_workers_one_running_out_of_memory,
    two_workers_without_world_size,
)
from support.launch.fairseq_helpers import USER_DIR, run_fairseq

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------- the catalogue: one row per case (the
# runner: tests/support/launch/bad_input_runner.py; what each case runs on: bad_input_makers.py; the fixtures
# that start the runs two at a time: tests/cli/conftest.py)

# The same size as the set's own file (same shapes, other values): the manifest's sha256 tells them apart.
ANOTHER_RUNS_FILE = (
    "checkpoint_last-rank-1-of-2.pt does not match its sha256 in the manifest (corrupted, or replaced by another "
    "run's file)"
)


# fmt: off
CASES = [
    # -- MoE flags, checked while fairseq parses the command line (nothing read, nothing created)
    Case("top-k-above-expert-count", fairseq_train, fresh_training("--moe-top-k", "5"), TRAIN,
         "--moe-top-k 5 exceeds --moe-expert-count 4", "use --moe-top-k <= 4"),
    Case("top-k-zero", fairseq_train, fresh_training("--moe-top-k", "0"), TRAIN,
         "--moe-top-k must be an integer >= 1, got 0", "use 1 <= --moe-top-k <= 4"),
    Case("zero-experts", fairseq_train, fresh_training("--moe-expert-count", "0"), TRAIN,
         "--moe-expert-count must be a positive integer, got 0", "use 1 or more experts"),
    Case("nan-capacity-factor", fairseq_train, fresh_training("--moe-capacity-factor", "nan"), TRAIN,
         "--moe-capacity-factor must be a finite number, got nan", "use 0 for dropless routing"),
    Case("infinite-eval-capacity-factor", fairseq_train, fresh_training("--moe-eval-capacity-factor", "inf"),
         TRAIN, "--moe-eval-capacity-factor must be a finite number, got inf",
         "> 0 for a fixed capacity, < 0 for a bounded dropless one"),
    Case("negative-gate-noise", fairseq_train, fresh_training("--moe-gate-noise", "-1"), TRAIN,
         "--moe-gate-noise must be a finite number >= 0, got -1.0", "use 0 (no noise) or a standard deviation > 0"),
    Case("negative-moe-freq", fairseq_train, fresh_training("--moe-freq", "-1"), TRAIN,
         "--moe-freq must be an integer >= 0, got -1", "use N for an MoE layer every N layers, or 0 for none"),
    Case("moe-freq-placing-no-moe-layer", fairseq_train, fresh_training("--moe-freq", "4"), TRAIN,
         "--moe-freq 4 places no MoE layer in this model (2 encoder layers and 2 decoder layers;",
         "use a frequency between 1 and 2, or a dense --arch (transformer, transformer_lm)"),
    Case("zero-expert-ffn-dim", fairseq_train, fresh_training("--moe-expert-ffn-dim", "0"), TRAIN,
         "--moe-expert-ffn-dim must be a positive integer, got 0", "drop it to use the layer's ffn dim"),
    Case("zero-expert-parallel-size", fairseq_train, fresh_training("--moe-expert-parallel-size", "0"), TRAIN,
         "--moe-expert-parallel-size must be a positive integer, got 0",
         "use a P dividing both the number of workers and --moe-expert-count, or drop it for the default"),
    Case("zero-comm-timeout", fairseq_train, fresh_training("--moe-comm-timeout", "0"), TRAIN,
         "--moe-comm-timeout must be a positive number of seconds, got 0.0", "use e.g. 600"),
    Case("unknown-router", fairseq_train, fresh_training("--moe-router", "hash"), TRAIN,
         "argument --moe-router: invalid choice: 'hash'", "choose from 'top', 'cosine'"),
    Case("negative-shared-expert-count", fairseq_train, fresh_training("--moe-shared-expert-count", "-1"),
         TRAIN, "--moe-shared-expert-count must be an integer >= 0, got -1", "use 0 for no shared experts"),
    Case("bias-update-rate-without-bias-balancing", fairseq_train, fresh_training("--moe-bias-update-rate", "0.01"),
         TRAIN, "--moe-bias-update-rate has no effect without --moe-balance bias", "add it or drop the rate"),
    Case("zero-bias-update-rate", fairseq_train,
         fresh_training("--moe-balance", "bias", "--moe-bias-update-rate", "0"), TRAIN,
         "--moe-bias-update-rate must be a finite number > 0, got 0.0", "use e.g. 0.001"),
    Case("sigmoid-router-with-one-expert-per-token", fairseq_train,
         fresh_training("--moe-router", "sigmoid", "--moe-top-k", "1"), TRAIN,
         "--moe-router sigmoid normalises the gates over the chosen experts, so with --moe-top-k 1 every gate is 1",
         "use --moe-top-k 2 or more, or --moe-router top"),
    Case("language-model-top-k-above-expert-count", fairseq_train,
         fresh_lm_training("--moe-expert-count", "2", "--moe-top-k", "3"), TRAIN,
         "--moe-top-k 3 exceeds --moe-expert-count 2", "use --moe-top-k <= 2"),
    # -- MoE options and components next to dense ones
    Case("moe-flag-on-a-dense-architecture", fairseq_train,
         fresh_training("--moe-expert-count", "4", arch="transformer", criterion="label_smoothed_cross_entropy"),
         TRAIN, "--moe-expert-count is an option of the MoE architectures only",
         "not of --arch transformer; pass one of them as --arch, or drop --moe-expert-count"),
    Case("moe-loss-flag-with-a-plain-criterion", fairseq_train,
         fresh_training("--moe-gate-loss-wt", "0.1", criterion="label_smoothed_cross_entropy"), TRAIN,
         "--moe-gate-loss-wt is an option of the MoE criterions only",
         "pass one of them as --criterion, or drop --moe-gate-loss-wt"),
    Case("moe-criterion-on-a-dense-architecture", fairseq_train,
         fresh_training("--encoder-layers", "1", "--decoder-layers", "1", arch="transformer"), TRAIN,
         "--criterion moe_label_smoothed_cross_entropy collects MoE balance losses, but --arch transformer has "
         "no MoE layers", "use --arch moe_transformer* / moe_transformer_lm*"),
    Case("plain-criterion-on-an-moe-architecture", fairseq_train,
         fresh_training(criterion="label_smoothed_cross_entropy"),
         TRAIN,
         "MoE balance losses of 2 layer run(s) from the previous training forward pass were never collected",
         "train MoE models with an MoE criterion (--criterion moe_cross_entropy or moe_label_smoothed_cross_entropy)"),
    # -- several workers
    Case("expert-parallel-size-not-dividing-the-workers", two_workers, fresh_training("--moe-expert-parallel-size", "3"),
         LAUNCHED_TRAIN, "--moe-expert-parallel-size 3 does not divide the 2 workers",
         "use a P dividing both 2 and --moe-expert-count 4 (1 or 2)"),
    Case("expert-parallel-size-not-dividing-the-experts", two_workers,
         fresh_training("--moe-expert-count", "3", "--moe-expert-parallel-size", "2"), LAUNCHED_TRAIN,
         "--moe-expert-parallel-size 2 does not divide --moe-expert-count 3",
         "use a P dividing both 2 and --moe-expert-count 3 (1)"),
    Case("ddp-backend-that-would-average-experts", two_workers, fresh_training("--ddp-backend", "slowmo"),
         LAUNCHED_TRAIN, "--ddp-backend slowmo is not supported with MoE models",
         "use --ddp-backend legacy_ddp (or c10d / pytorch_ddp / fully_sharded)"),
    # -- --ddp-backend fully_sharded (torch FSDP2): options it cannot honour, checked while parsing
    Case("fully-sharded-with-cpu-offload", fairseq_train, fresh_training("--ddp-backend", "fully_sharded", "--cpu-offload"),
         TRAIN, "--cpu-offload is fairscale's and is not supported with --ddp-backend fully_sharded",
         "drop --cpu-offload"),
    Case("fully-sharded-with-sharded-state", fairseq_train,
         fresh_training("--ddp-backend", "fully_sharded", "--use-sharded-state"), TRAIN,
         "--use-sharded-state writes fairscale's per-shard files", "drop --use-sharded-state"),
    Case("fully-sharded-with-ema", fairseq_train, fresh_training("--ddp-backend", "fully_sharded", "--store-ema"),
         TRAIN, "--store-ema keeps a whole copy of the model on every worker",
         "drop --store-ema or use --ddp-backend legacy_ddp"),
    Case("fully-sharded-with-adafactor", fairseq_train,
         fresh_training("--ddp-backend", "fully_sharded", "--optimizer", "adafactor"), TRAIN,
         "--optimizer adafactor factors its second moment into row and column means",
         "use an element-wise optimizer (adam, sgd, nag, adagrad, adadelta, adamax) or --ddp-backend legacy_ddp"),
    Case("zero-sharding-of-expert-optimizer-state", fairseq_train, fresh_training("--zero-sharding", "os"),
         TRAIN, "--zero-sharding os broadcasts every worker's optimizer shard",
         "use --ddp-backend fully_sharded"),
    Case("out-of-memory-on-one-of-two-workers", two_workers_one_running_out_of_memory,
         fresh_training("--no-save", "--moe-comm-timeout", "30"),  # a hang would end there, not at 600 s
         OOM_PROBE,
         "worker 1 of 2 ran out of device memory in training",
         "bound them with --moe-capacity-factor (e.g. 1.25) or lower --max-tokens"),
    Case("launcher-and-fairseq-disagree-on-world-size", two_workers_without_world_size, fresh_training(),
         LAUNCHED_TRAIN, "the launcher started 2 workers (WORLD_SIZE=2) but fairseq runs each of them as a 1-worker job",
         "add --distributed-world-size 2"),
    # -- resuming
    Case("resume-with-another-expert-count", fairseq_train, resume("--moe-expert-count", "8"), TRAIN,
         "holds 4 experts in encoder.layers.1.fc1, this model 8",
         "resume with the checkpoint's --moe-expert-count, or use a new --save-dir"),
    Case("resume-with-another-model-dimension", fairseq_train, resume("--encoder-embed-dim", "32"), TRAIN,
         "does not fit this model: encoder.embed_tokens.weight is (48, 64) there and (48, 32) here",
         "resume with the architecture flags the checkpoint was trained with, or use a new --save-dir"),
    Case("resume-with-another-router", fairseq_train, resume("--moe-router", "cosine"), TRAIN,
         "was trained with --moe-router top and this run has --moe-router cosine",
         "resume with --moe-router top, or use a new --save-dir"),
    Case("resume-with-shared-experts-added", fairseq_train, resume("--moe-shared-expert-count", "1"), TRAIN,
         "was trained with --moe-shared-expert-count 0 and this run has --moe-shared-expert-count 1",
         "resume with --moe-shared-expert-count 0, or use a new --save-dir"),
    Case("resume-from-a-checkpoint-pickling-a-disallowed-type", fairseq_train,
         resume(damage=lambda d: pickle_a_disallowed_type(d / "checkpoint_last.pt")), TRAIN,
         f"checkpoint_last.pt: it pickles {Smuggled.__module__}.Smuggled, which is not among the types fairseq "
         "checkpoints store",
         "if you trust the file, add the type to fairseq_moe_ext.checkpoint.CHECKPOINT_SAFE_GLOBALS"),
    Case("resume-from-a-truncated-file", fairseq_train, resume(damage=lambda d: truncate(d / "checkpoint_last.pt")),
         TRAIN, "checkpoint_last.pt is damaged or incomplete (File is not a zip file)",
         "restore it from a backup, or point --path / --restore-file at another checkpoint"),
    Case("resume-from-a-set-with-another-runs-rank-file", fairseq_train,
         with_inputs(lambda inputs: resume(damage=replace_rank_1_with_another_runs(inputs), source="set")), TRAIN,
         f"{ANOTHER_RUNS_FILE}) and no complete set exists in",
         "restore the set's files from a backup, or start afresh in a new --save-dir"),
    Case("resume-where-a-name-has-two-layouts", fairseq_train,
         resume(damage=lambda d: (d / "checkpoint_last-rank-0-of-2.pt").write_bytes(b"not really")), TRAIN,
         "checkpoint_last.pt exists beside per-rank files of the same name", "two layouts for one checkpoint; "
         "move one of them away"),
    Case("restore-file-naming-a-damaged-set", fairseq_train, restore_file_naming_a_damaged_set(), TRAIN,
         "checkpoint_last.set.json cannot be loaded: rank 1 file",
         "or add --moe-restore-fallback to train from the newest complete set in"),
    # -- one job per save dir
    Case("save-dir-locked-by-a-running-job", fairseq_train, resume(damage=lock_held_by_this_test_runner),
         TRAIN, "is locked by job first (pid",
         "which is still running: two jobs saving into one directory overwrite each other's checkpoints; give this "
         "run another --save-dir, or, if that job is gone, delete"),
    Case("save-dir-locked-by-a-running-job-on-two-workers", two_workers, locked_fresh_save_dir(),
         LAUNCHED_TRAIN, "is locked by job first (pid",
         "give this run another --save-dir, or, if that job is gone, delete"),
    # -- generation: --path never loads anything but the complete, intact checkpoint it names
    Case("generate-from-a-set-missing-a-rank-file", fairseq_generate,
         generate_from("set", lambda d: (d / "checkpoint_last-rank-1-of-2.pt").unlink()), GENERATE,
         "checkpoint_last-rank-1-of-2.pt is missing", "restore the set from a backup, or point --path"),
    Case("generate-from-a-set-with-a-corrupted-rank-file", fairseq_generate,
         generate_from("set", lambda d: flip_bytes_in_the_middle(d / "checkpoint_last-rank-1-of-2.pt")), GENERATE,
         "checkpoint_last-rank-1-of-2.pt does not match its sha256 in the manifest",
         "restore the set from a backup, or point --path"),
    Case("generate-from-a-set-with-another-runs-rank-file", fairseq_generate,
         with_inputs(lambda inputs: generate_from("set", replace_rank_1_with_another_runs(inputs))), GENERATE,
         ANOTHER_RUNS_FILE, "restore the set from a backup, or point --path"),
    Case("generate-from-a-stale-rank-file-of-another-world-size", fairseq_generate,
         generate_from("set", leave_a_rank_file_of_a_4_worker_save, path="checkpoint_last-rank-0-of-4.pt"), GENERATE,
         "checkpoint_last-rank-0-of-4.pt is not part of the checkpoint set",
         "pass the set's plain name"),
    Case("generate-from-a-truncated-file", fairseq_generate,
         generate_from("single", lambda d: truncate(d / "checkpoint_last.pt")), GENERATE,
         "checkpoint_last.pt is damaged or incomplete", "restore it from a backup, or point --path"),
    Case("generate-from-a-corrupted-file", fairseq_generate,
         generate_from("single", lambda d: flip_bytes_in_the_middle(d / "checkpoint_last.pt")), GENERATE,
         "checkpoint_last.pt is damaged or incomplete (Bad CRC-32 for file",
         "restore it from a backup, or point --path"),
    # -- the checkpoint tool never overwrites and never writes half a set
    Case("reshard-to-an-expert-parallel-size-not-dividing-the-experts", checkpoint_tool,
         checkpoint_tool_on("reshard", "--world-size", "3", "--expert-parallel-size", "3"), "error",
         "--expert-parallel-size 3 must divide both --world-size 3 and the 4 experts", "use one of [1]"),
    Case("reshard-to-zero-workers", checkpoint_tool, checkpoint_tool_on("reshard", "--world-size", "0"), "error",
         "--world-size must be a positive number of workers, got 0",
         "use the number of workers that will resume from the set"),
    Case("reshard-onto-a-single-file-of-the-same-name", checkpoint_tool,
         checkpoint_tool_on("reshard", "--world-size", "2", existing="single"), "error",
         "out/checkpoint_last.pt exists", "choose another output name (nothing was overwritten)"),
    Case("merge-onto-a-set-of-the-same-name", checkpoint_tool, checkpoint_tool_on("merge", existing="set"), "error",
         "out/checkpoint_last.set.json exists", "choose another output name (nothing was overwritten)"),
    Case("merge-into-a-missing-directory", checkpoint_tool, tool_on_copy("merge", "set", lambda d: None, output="missing"),
         "error", "out does not exist", "create it first, or choose another output name (nothing was written)"),
    # -- sparse upcycling: only a dense checkpoint with fairseq's FFN, into experts of its size, into a new name
    Case("upcycle-a-checkpoint-without-fc1-fc2", checkpoint_tool, upcycle(damage=drop_the_ffn_blocks), "error",
         "has no fairseq feed-forward block (no encoder/decoder.layers.N.fc1/fc2 weights)",
         "upcycling needs a dense checkpoint of an architecture whose FFN is fc1/fc2 (transformer, transformer_lm)"),
    Case("upcycle-an-moe-checkpoint", checkpoint_tool, upcycle(source="single"), "error",
         "checkpoint_last.pt is already an MoE checkpoint (it holds experts)",
         "upcycling starts from a dense fairseq checkpoint; train on from this one with --restore-file"),
    Case("upcycle-into-experts-of-another-hidden-size", checkpoint_tool, upcycle("--moe-expert-ffn-dim", "256"),
         "error", "--moe-expert-ffn-dim 256 differs from the dense FFN's hidden size 128 (decoder.layers.0.fc1",
         "every expert starts as a copy of the dense FFN; drop --moe-expert-ffn-dim or pass 128"),
    Case("upcycle-onto-an-existing-checkpoint", checkpoint_tool, upcycle(existing="single"), "error",
         "out/checkpoint_last.pt exists", "choose another output name (nothing was overwritten)"),
    Case("train-upcycled-without-normalised-gates", fairseq_train, training_upcycled_from_the_dense_model(),
         TRAIN, "--moe-upcycle-from needs --moe-normalize-gate: without it a token's k gates sum to less than 1",
         "add --moe-normalize-gate"),
    Case("train-upcycled-into-experts-of-another-hidden-size", fairseq_train,
         training_upcycled_from_the_dense_model("--moe-normalize-gate", "--moe-expert-ffn-dim", "256"), TRAIN,
         "--moe-expert-ffn-dim 256 differs from the dense FFN's hidden size 128", "drop --moe-expert-ffn-dim or pass 128"),
    Case("train-upcycled-with-a-cosine-router", fairseq_train,
         training_upcycled_from_the_dense_model("--moe-normalize-gate", "--moe-router", "cosine"), TRAIN,
         "this run has --moe-router cosine", "use --moe-router top"),
    Case("train-upcycled-and-restored-from-a-file-at-once", fairseq_train,
         training_upcycled_from_the_dense_model("--moe-normalize-gate", "--restore-file", "elsewhere.pt"), TRAIN,
         "--moe-upcycle-from and --restore-file both name a checkpoint to start from", "pass one of them"),
    # -- a manifest is untrusted input: no file outside the set's directory is ever opened
    Case("generate-from-a-set-whose-manifest-names-a-file-in-another-directory", fairseq_generate,
         generate_from("set", list_rank_1_from_another_directory(absolute=False)), GENERATE,
         "field files[1].name must be 'checkpoint_last-rank-1-of-2.pt', got '../elsewhere/checkpoint_last-rank-1-of-2.pt' "
         "(a path: a set's files must lie beside its manifest)", "restore it from a backup, or move the set out"),
    Case("generate-from-a-set-whose-manifest-names-an-absolute-path", fairseq_generate,
         generate_from("set", list_rank_1_from_another_directory(absolute=True)), GENERATE,
         "elsewhere/checkpoint_last-rank-1-of-2.pt' (a path: a set's files must lie beside its manifest)",
         "restore it from a backup, or move the set out"),
    Case("inspect-a-set-whose-manifest-names-a-file-in-another-directory", checkpoint_tool,
         tool_on_copy("inspect", "set", list_rank_1_from_another_directory(absolute=False)), "error",
         "got '../elsewhere/checkpoint_last-rank-1-of-2.pt' (a path", "restore it from a backup, or move the set out"),
    Case("inspect-a-set-whose-manifest-names-an-absolute-path", checkpoint_tool,
         tool_on_copy("inspect", "set", list_rank_1_from_another_directory(absolute=True)), "error",
         "elsewhere/checkpoint_last-rank-1-of-2.pt' (a path", "restore it from a backup, or move the set out"),
    # -- a .pt file that is not a fairseq checkpoint at all
    Case("generate-from-a-pt-file-holding-a-list", fairseq_generate,
         generate_from("single", lambda d: torch.save([1, 2], d / "checkpoint_last.pt")), GENERATE,
         "checkpoint_last.pt is not a fairseq checkpoint: it holds a list",
         "point --path / --restore-file (or the checkpoint tool) at a checkpoint written by fairseq-train"),
    Case("inspect-a-pt-file-holding-a-dict-of-something-else", checkpoint_tool,
         tool_on_copy("inspect", "single", lambda d: torch.save({"a": 1}, d / "checkpoint_last.pt")), "error",
         "checkpoint_last.pt is not a fairseq checkpoint: it holds a dict without a model state (keys ['a'])",
         "point --path / --restore-file (or the checkpoint tool) at a checkpoint written by fairseq-train"),
    # -- a rank file out of its set is recognised as a part, and names its set
    Case("generate-from-a-rank-file-renamed-to-a-plain-name", fairseq_generate,
         generate_from("set", rename_rank_1_to_a_plain_name, path="checkpoint_x.pt"), GENERATE,
         "checkpoint_x.pt is one part of a checkpoint set, not a whole checkpoint: rank 1 of 2 (set ",
         "put it back beside its set's other rank files and manifest, and pass the set's name"),
    Case("merge-a-rank-file-copied-out-of-its-set", checkpoint_tool,
         tool_on_copy("merge", "set", keep_only_rank_1, path="checkpoint_last-rank-1-of-2.pt", output="existing"),
         "error", "1 rank files (the first is rank 1 of 2 of checkpoint_last (set ",
         "copy the set's other rank files and its manifest beside them"),
]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input_fails_in_one_line_naming_problem_and_fix_and_changes_no_file(case, started):
    check_case(case, started[case.id])


# ---------------------------------------------------------------- what is not an error


def test_a_missing_plain_name_stays_fairseqs_own_error(checkpoints, tmp_path):
    inputs = checkpoints.result()
    directory = copy_of(inputs.single, tmp_path)
    (directory / "checkpoint_last-rank-0-of-2.pt").write_bytes(b"not really")
    output = run_fairseq(
        "generate",
        str(inputs.data),
        "--user-dir",
        USER_DIR,
        "--cpu",
        "--path",
        str(directory / "checkpoint_last.pt.missing"),
        expect_failure=True,
    )
    assert "Model file not found" in output


def test_a_rank_file_given_as_path_stands_for_its_whole_set(checkpoints):
    """Alone, a rank file holds one worker's experts; --path to it loads the set that lists it,
    as the plain name does (and as --restore-file and the checkpoint tool do)."""
    inputs = checkpoints.result()
    output = run_fairseq("generate", *generate_args(inputs.data, inputs.set / "checkpoint_last-rank-1-of-2.pt"))
    assert re.search(r"^H-\d+\t", output, flags=re.M) and "BLEU" in output
