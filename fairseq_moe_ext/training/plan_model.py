"""The model ``fairseq-moe plan`` plans for: fairseq-train's parse of its arguments (a refusal as one
``PlanError`` line), the task set up with dictionaries of ``--dictionary-size`` symbols held in memory when the
data directory is not there yet (a model's shapes need a dictionary's length, not its words), and the model built
on the ``meta`` device (shapes only: no memory, no weights). ``plan_cli.py`` turns it into the table.
"""

import contextlib
import io
import os
from typing import List, Optional

from ..common.config_value import config_value
from .teacher_plan import CRITERION  # a dense student of this criterion is planned beside its teacher

NO_PAIR = (
    "the translation task reads the language pair from the data directory's file names, and there are none to "
    "read: add --source-lang and --target-lang"
)


class PlanError(ValueError):
    """A bad argument: printed as one line."""


@contextlib.contextmanager
def dictionaries_of_size(size: Optional[int]):
    """While the task is set up, every dictionary fairseq loads is ``size`` symbols held in memory (fairseq's
    4 specials and ``plan0`` ... ``plan{size-5}``), whatever file it names: nothing is read or written."""
    if size is None:
        yield
        return
    from fairseq.data import Dictionary

    def load(cls, f, *args, **kwargs):
        dictionary = cls()
        dictionary.symbols.extend(f"plan{i}" for i in range(size - len(dictionary)))
        dictionary.count.extend([1] * (size - len(dictionary.count)))
        dictionary.indices.update((symbol, i) for i, symbol in enumerate(dictionary.symbols))
        return dictionary

    original = Dictionary.__dict__["load"]
    Dictionary.load = classmethod(load)
    try:
        yield
    finally:
        Dictionary.load = original


def parsed_training_args(argv: List[str]):
    """fairseq-train's parse of ``argv``; its refusal (argparse prints it and exits) as one PlanError line."""
    from fairseq import options

    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            return options.parse_args_and_arch(options.get_training_parser(), argv)
    except SystemExit as exit:
        said = [line.split(": error: ", 1)[1] for line in printed.getvalue().splitlines() if ": error: " in line]
        if exit.code == 0:  # --help: fairseq-train's own help was printed
            raise
        raise PlanError(
            f"fairseq-train refused these arguments ({said[-1] if said else f'exit status {exit.code}'}): plan takes "
            f"fairseq-train's arguments plus --world-size W; fix the argument it names"
        ) from None


def build_on_meta(argv: List[str], dictionary_size: Optional[int]):
    """(cfg, args, model) as fairseq-train builds them, the model's tensors on the meta device."""
    cfg, args, _, model = build_task_and_model(argv, dictionary_size)
    return cfg, args, model


def build_task_and_model(argv: List[str], dictionary_size: Optional[int]):
    """(cfg, args, task, model): ``build_on_meta``'s, with the task the model was built for."""
    import torch
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq import tasks

    if "--user-dir" not in argv:
        argv = [*argv, "--user-dir", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    if dictionary_size is not None and (not argv or argv[0].startswith("-")):
        argv = ["plan-without-data", *argv]  # fairseq-train's DATA, never read: the dictionaries are in memory
    args = parsed_training_args(argv)
    arch = config_value(args, "arch")
    distilled = str(config_value(args, "criterion")) == CRITERION  # a dense student of a teacher is planned too
    if arch is None or not (str(arch).startswith("moe_") or distilled):
        raise PlanError(
            f"--arch {arch} is not an MoE architecture of this plugin: plan is for moe_transformer* and "
            f"moe_transformer_lm* models (a dense student with --criterion {CRITERION} --distill-teacher PATH)"
        )
    cfg = convert_namespace_to_omegaconf(args)
    try:
        with dictionaries_of_size(dictionary_size):
            task = tasks.setup_task(cfg.task)
    except FileNotFoundError as error:
        if dictionary_size is None:
            raise PlanError(
                f"{error.filename or error}: no dictionaries to build the model with: give the data "
                f"directory fairseq-train reads, or --dictionary-size N to plan before it exists"
            ) from None
        raise PlanError(f"{error.filename or error}: {NO_PAIR}") from None
    except Exception as error:  # noqa: BLE001 - fairseq's translation task raises a bare Exception for this
        if "infer language pair" not in str(error):
            raise
        raise PlanError(f"{argv[0]}: {NO_PAIR}") from None
    with torch.device("meta"):
        model = task.build_model(cfg.model)
    return cfg, args, task, model
