"""Bad input, distillation: ``fairseq-train --criterion moe_distillation`` refuses, before training starts and in
one line naming ``--distill-*`` and the fix, a missing teacher, a teacher set that is damaged, a teacher of
another task or of other dictionaries (another size, or the same size with other symbols), a temperature
<= 0, a mix weight outside [0, 1], a top-k beyond the vocabulary, and a distillation flag given to another
criterion. The same table-driven runner as tests/cli/test_bad_input.py (each case through the real command
line: status 2, one last line naming the problem and the fix, no file changed or added)."""

import shutil

import pytest

from support.inputs.bad_input_makers import flip_bytes_in_the_middle, fresh_training
from support.launch.bad_input_runner import TRAIN, Case, check_case, copy_of, fairseq_train, train_args
from support.launch.fairseq_helpers import run_fairseq

pytestmark = pytest.mark.slow


def distil(*flags, teacher="set", damage=None, data=None):
    """fairseq-train of a student of the inputs' ``teacher`` (a copy, ``damage`` applied to it), on the inputs'
    data or on ``data(inputs, work)``; the student's save dir and the teacher's copy must not change."""

    def make(inputs, work):
        source = copy_of(getattr(inputs, teacher), work, "teacher")
        if damage is not None:
            damage(source)
        corpus = inputs.data if data is None else data(inputs, work)
        save_dir = work / "ck"
        args = train_args(corpus, save_dir, "--max-update", "2", "--distill-teacher",
                          str(source / "checkpoint_last.pt"), *flags, criterion="moe_distillation")  # fmt: skip
        return args, [save_dir, source]

    return make


def language_model_teacher(inputs, work):
    """A 1-update moe_transformer_lm of the inputs' language-model corpus, as the teacher of a translation run."""
    save_dir = work / "lm"
    lm = train_args(inputs.lm_data, save_dir, "--task", "language_modeling", "--tokens-per-sample", "32",
                    "--max-update", "1", arch="moe_transformer_lm", criterion="moe_cross_entropy")  # fmt: skip
    run_fairseq("train", *lm)
    args = train_args(inputs.data, work / "ck", "--max-update", "2", "--distill-teacher",
                      str(save_dir / "checkpoint_last.pt"), criterion="moe_distillation")  # fmt: skip
    return args, [work / "ck", save_dir]


def data_with_target_dictionary(edit):
    """A copy of the inputs' corpus whose target dictionary ``edit`` changed (its binarised files as they were)."""

    def data(inputs, work):
        copy = work / "data"
        shutil.copytree(inputs.data, copy)
        lines = (copy / "dict.tgt.txt").read_text().splitlines()
        (copy / "dict.tgt.txt").write_text("\n".join(edit(lines)) + "\n")
        return copy

    return data


def one_more_entry(lines):
    return [*lines, "zzz-never-seen 1"]


def first_two_swapped(lines):
    return [lines[1], lines[0], *lines[2:]]


def damage_rank_1(directory):
    flip_bytes_in_the_middle(directory / "checkpoint_last-rank-1-of-2.pt")


# fmt: off
CASES = [
    Case("distillation-without-a-teacher", fairseq_train, fresh_training(criterion="moe_distillation"), TRAIN,
         "--criterion moe_distillation needs a teacher", "add --distill-teacher PATH"),
    Case("missing-teacher", fairseq_train, fresh_training("--distill-teacher", "/nonexistent/ck/checkpoint_best.pt",
         criterion="moe_distillation"), TRAIN,
         "--distill-teacher /nonexistent/ck/checkpoint_best.pt: no checkpoint or checkpoint set there",
         "give the teacher's checkpoint"),
    Case("damaged-teacher-set", fairseq_train, distil(damage=damage_rank_1), TRAIN,
         "checkpoint_last-rank-1-of-2.pt does not match its sha256 in the manifest",
         "give --distill-teacher a complete set or file"),
    Case("teacher-of-another-task", fairseq_train, language_model_teacher, TRAIN,
         "was trained for --task language_modeling and this run is --task translation",
         "distil from a teacher of this task"),
    Case("teacher-of-a-dictionary-of-another-size", fairseq_train,
         distil(data=data_with_target_dictionary(one_more_entry)), TRAIN,
         "has a target vocabulary of", "distil from a teacher of these dictionaries"),
    Case("teacher-of-a-dictionary-with-other-symbols", fairseq_train,
         distil(data=data_with_target_dictionary(first_two_swapped)), TRAIN,
         "was trained with another target dictionary (entry 4 is", "distil from a teacher of these dictionaries"),
    Case("temperature-zero", fairseq_train, distil("--distill-temperature", "0"), TRAIN,
         "--distill-temperature must be a finite number > 0, got 0.0", "use e.g. 1 (the default) or 2"),
    Case("negative-temperature", fairseq_train, distil("--distill-temperature", "-2"), TRAIN,
         "--distill-temperature must be a finite number > 0, got -2.0", "use e.g. 1 (the default) or 2"),
    Case("mix-weight-above-one", fairseq_train, distil("--distill-weight", "1.5"), TRAIN,
         "--distill-weight must be a number between 0 and 1, got 1.5", "0 for the labels only or 1 for the teacher only"),
    Case("negative-mix-weight", fairseq_train, distil("--distill-weight", "-0.1"), TRAIN,
         "--distill-weight must be a number between 0 and 1, got -0.1", "use e.g. 0.5 (the default)"),
    Case("top-k-beyond-the-vocabulary", fairseq_train, distil("--distill-top-k", "100000"), TRAIN,
         "--distill-top-k 100000 keeps more tokens than the teacher's", "or 0 for the whole vocabulary"),
    Case("distillation-flag-with-another-criterion", fairseq_train, fresh_training("--distill-weight", "0.5"), TRAIN,
         "--distill-weight is an option of the distillation criterion only (--criterion moe_distillation)",
         "pass one of them as --criterion, or drop --distill-weight"),
]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input_fails_in_one_line_naming_problem_and_fix_and_changes_no_file(case, started):
    check_case(case, started[case.id])
