"""Hook 10: an MoE option given beside a dense --arch or --criterion says whose option it is."""

import functools
import sys

from fairseq.models import ARCH_MODEL_REGISTRY

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
        owners[option] = ("--criterion", "the MoE criterions", "moe_label_smoothed_cross_entropy, moe_cross_entropy")
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
