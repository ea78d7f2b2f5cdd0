"""Hook 10: an MoE option given beside a dense --arch or --criterion says whose option it is. And every
MoE refusal (``common.refusal.MoERefusal``) that ends a fairseq command-line tool is one line,
``prog: error: <message>``, with argparse's exit status 2 (``install_refusal_excepthook``, installed with
the hooks), whether raised while parsing or later; on several workers each names its rank. In process, a
refusal is raised as it is (a ValueError for an option)."""

import atexit
import contextlib
import functools
import json
import os
import sys
import time

import torch
from fairseq.models import ARCH_MODEL_REGISTRY

from ..common.refusal import MoERefusal
from ..criterions.distillation import DistillationOptions
from ..criterions.moe_criterions import MoELossConfig
from ..models.moe_config import MoEConfig, MoEEncoderDecoderConfig
from ..models.moe_transformer import MoETransformerLanguageModel, MoETransformerModel


def wrap_argparse_error(original):
    @functools.wraps(original)
    def error(self, message):
        return original(self, explain_unrecognized_moe_option(message) or message)

    return error


def explain_unrecognized_moe_option(message: str):
    """fairseq adds a model's and a criterion's options to its parser only for the --arch and
    --criterion given, so an MoE option next to a dense one is merely "unrecognized"; say whose it is."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return None

    def options(config):
        return {"--" + name.replace("_", "-") for name in config.__dataclass_fields__ if name != "_name"}

    def archs(*models):
        return ", ".join(sorted(a for a, m in ARCH_MODEL_REGISTRY.items() if m in models))

    owners = {}
    for option in options(MoEEncoderDecoderConfig) - options(MoEConfig):
        owners[option] = ("--arch", "the MoE translation architectures", archs(MoETransformerModel))
    for option in options(MoEConfig):
        owners[option] = ("--arch", "the MoE architectures", archs(MoETransformerModel, MoETransformerLanguageModel))
    for option in options(MoELossConfig):
        owners[option] = (
            "--criterion",
            "the MoE criterions",
            "moe_label_smoothed_cross_entropy, moe_cross_entropy, moe_distillation",
        )
    for option in options(DistillationOptions):
        owners[option] = ("--criterion", "the distillation criterion", "moe_distillation")
    for word in message[len(prefix) :].split():
        option = word.split("=", 1)[0]
        if option in owners:
            kind, whose, names = owners[option]
            given = given_option(kind)
            return (
                f"{message}: {option} is an option of {whose} only ({kind} {names})"
                + (f", not of {kind} {given}" if given else "")
                + f"; pass one of them as {kind}, or drop {option}"
            )
    return None


def given_option(name: str):
    """The value of ``--arch`` / ``--criterion`` on this process's command line, if any."""
    argv = sys.argv[1:]
    spellings = (name, "-a") if name == "--arch" else (name,)
    for i, word in enumerate(argv):
        if word in spellings and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


# ---------------------------------------------------------------- MoE refusals: one line, exit status 2

USAGE_ERROR = 2  # argparse's exit status for a command line it refuses


def tell_the_launcher(line: str) -> None:
    """Under torchrun, the line as this worker's error file (the format of torch.distributed.elastic's
    ``@record``): torchrun's failure summary then shows it as the root cause's "traceback" instead of a
    link to torch's documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            extra = {"py_callstack": line, "timestamp": str(int(time.time()))}
            json.dump({"message": {"message": line, "extraInfo": extra}}, f)


def refusal_line(refusal: BaseException, prog: str) -> str:
    """``prog: error: <message>``; on one of several workers (connected, or started by torchrun), naming
    its rank: workers can refuse different things (their own files, their own memory), and where they refuse
    the same, torchrun stops the others when the first exits, so each says it (none waits for another)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1") or 1)
    where = f"rank {rank} of {world}: " if world > 1 else ""
    return f"{prog}: error: {where}{refusal}"


def install_refusal_excepthook() -> None:
    """An MoE refusal that ends the program (raised while fairseq parses the command line, builds the model,
    loads or saves a checkpoint, trains) prints ``refusal_line`` alone and exits with status 2; any other exception goes
    to the hook found here (Python's traceback). torch's init_process_group later wraps this hook to prefix
    what it prints with "[rankN]: "; the line is written past that wrapper, to the process's stderr."""
    previous = sys.excepthook
    if getattr(previous, "__moe_refusals__", False):
        return
    # argparse's prog, while the tool's module runs as __main__ (runpy may restore sys.argv[0] before the hook)
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "fairseq"

    def excepthook(kind, value, traceback):
        if not isinstance(value, MoERefusal):
            return previous(kind, value, traceback)
        stream = sys.__stderr__ or sys.stderr
        for out in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                out.flush()
        line = refusal_line(value, prog)
        tell_the_launcher(line)
        stream.write(line + "\n")
        stream.flush()
        atexit._run_exitfuncs()  # what the interpreter would run before exiting
        os._exit(USAGE_ERROR)

    excepthook.__moe_refusals__ = True
    sys.excepthook = excepthook
    # fairseq-hydra-train: hydra prints what a job raised with a traceback of its own and exits 1 unless
    # HYDRA_FULL_ERROR is set, when it re-raises to the interpreter (and so to this hook).
    if "hydra" in sys.modules:
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")
