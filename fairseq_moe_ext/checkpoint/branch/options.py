"""The options of a fairseq ``moe``/``nllb``-branch checkpoint, mapped to this project's flags.

The branch's MoE layer (``fairseq/modules/moe/top2gate.py`` and ``moe_layer.py`` on those branches)
routes every token to the argmax expert and its second expert by ``--moe-second-expert-policy``
(``--moe-second-expert-policy`` here, the same three policies and draws), renormalises the two gates after
capacity dropping unless ``--moe-normalize-gate-prob-before-dropping`` (``--moe-normalize-gate`` with or
without ``--moe-normalize-gate-after-dropping``), queues tokens for capacity in B x T order
(``--moe-batch-major-routing``), ranks them by top-1 probability with batch-prioritised routing, and has a
training capacity of ``2*ceil(S/E)`` slots per expert (``--moe-capacity-factor 1`` with top-2) and an
evaluation capacity of ``ceil(moe_eval_capacity_token_fraction * S)`` (``--moe-eval-capacity-token-fraction``,
S counting pads as the branch does). A layer i is MoE on a side when ``(i + 1) % max(<side>_moe_freq,
moe_freq) == 0``.

``branch_flags`` returns this project's flags and the NOTE lines for what is mapped but not
reproduced exactly; what cannot be represented at all is refused in one line naming the option.
Torch-free: plain dicts and Namespaces.
"""

import argparse
import math
from typing import Dict, List, Tuple

from ...common.config_value import config_value
from ...options import BRANCH_NAMES, OPTIONS
from ..errors import CheckpointSetError

# Options whose non-default value changes what the model computes in a way this project cannot.
# fmt: off
REFUSED = (
    # (option, is it set?, why, fix)
    ("moe_cmr", lambda v: bool(v), "CMR gating (a dense FFN mixed in by a learned gate)", "there is no CMR layer here"),
    ("base_layers", lambda v: bool(v), "BASE layers (balanced assignment)", "there is no BASE layer here"),
    ("moe_top1_expert", lambda v: bool(v), "top-1 gating with the branch's Top1Gate",
     "only the branch's top-2 gate is imported"),
    ("alternate_ffn_embed_dim", lambda v: bool(v), "pseudo-MoE dense blocks", "there are no pseudo-MoE blocks here"),
    ("alternate_decoder_ffn_embed_dim", lambda v: bool(v), "pseudo-MoE dense blocks",
     "there are no pseudo-MoE blocks here"),
    ("moe_fom", lambda v: bool(v), "final output masking (inference scales the MoE output by 1 - p)",
     "there is no final output masking here"),
)
# fmt: on
SECOND_EXPERT_POLICIES = ("all", "sampling", "random")


def model_options(state: Dict, path: str) -> argparse.Namespace:
    """The model options a branch file carries: ``cfg["model"]`` (a Namespace or a dict) or ``args``."""
    cfg = state.get("cfg")
    model = cfg.get("model") if isinstance(cfg, dict) else None
    if model is None:
        model = state.get("args")
    if isinstance(model, dict):
        model = argparse.Namespace(**model)
    if not isinstance(model, argparse.Namespace):
        raise CheckpointSetError(
            f"{path} carries no model options (neither cfg['model'] nor args): it was not written by fairseq-train "
            f"of the moe/nllb branch; point import-fairseq-moe at that run's <prefix> (its -shared.pt and -rank-N.pt)"
        )
    return model


# A moe-branch language model (moe_lm) option that stock fairseq's transformer_lm, which
# ``moe_transformer_lm`` builds, has no counterpart for.
# fmt: off
LM_REFUSED = (
    ("use_stable_embedding", "bitsandbytes' StableEmbedding (an embedding with a layer norm of its own)",
     "there is no StableEmbedding here"),
)
# fmt: on


def is_language_model(options: argparse.Namespace) -> bool:
    """A decoder-only ``transformer_lm`` (moe_lm) set: its arch (``transformer_lm``, ``transformer_lm_gpt``, ...)."""
    names = (str(branch_value(options, "arch", "")), str(branch_value(options, "_name", "")))
    return any(name.startswith("transformer_lm") for name in names)


def check_language_model(options: argparse.Namespace, path: str) -> None:
    """Refuse the moe_lm options ``moe_transformer_lm`` cannot represent. Everything else the branch's
    ``TransformerLanguageModelConfig`` holds is stock fairseq's option of the same name and meaning
    (positions learned or sinusoidal, tied embeddings, pre-norm), carried over as it is."""
    for name, what, why in LM_REFUSED:
        value = branch_value(options, name)
        if value:
            raise CheckpointSetError(
                f"{path} was trained with --{name.replace('_', '-')} ({what}): {why}, so the import would change "
                f"what the language model computes (nothing was written)"
            )


def branch_value(options, name, default=None):
    """The branch's option (its own flag of that name, not this plugin's: read as the branch wrote it), or
    ``default`` where it is unset: the branch's args hold None for that."""
    value = config_value(options, name)
    return default if value is None else value


def branch_flags(options: argparse.Namespace, path: str, layers: Dict[str, int]) -> Tuple[Dict, List[str]]:
    """(this project's MoE flags, NOTE lines) for a branch model with ``layers[side]`` layers."""
    for name, is_set, what, why in REFUSED:
        value = branch_value(options, name)
        if is_set(value):
            raise CheckpointSetError(
                f"{path} was trained with --{name.replace('_', '-')} {value} ({what}): {why}, so the import would "
                f"change what the model computes (nothing was written)"
            )
    arch = str(branch_value(options, "arch", branch_value(options, "_name", "")))
    if (
        "megatron" in arch
        or "model_parallel" in str(branch_value(options, "_name", ""))
        or ("lm" in arch.split("_") and not is_language_model(options))
    ):
        raise CheckpointSetError(
            f"{path} is a {arch!r} language model: import-fairseq-moe imports the branch's transformer_lm (moe_lm) and "
            f"translation transformers; other language models (model-parallel, convolutional) have other keys "
            f"(nothing was written)"
        )
    if is_language_model(options):
        check_language_model(options, path)
    policy = str(branch_value(options, "moe_second_expert_policy", "sampling"))
    if policy not in SECOND_EXPERT_POLICIES:
        raise CheckpointSetError(
            f"{path} has --moe-second-expert-policy {policy!r}, which the branch's top-2 gate does not define "
            f"(all, sampling, random): an unknown gate option (nothing was written)"
        )
    notes = []
    # The branch routes B x T (batch-major) tensors, renormalises after dropping unless told otherwise, and
    # draws its second expert as its policy says, in evaluation too: each is an option here, set to match.
    after = not branch_value(options, "moe_normalize_gate_prob_before_dropping", False)
    # The options carried as they are; absent, the type's zero (no expert count, no prioritising).
    carried = {name: OPTIONS[name].type for name in BRANCH_NAMES}
    flags = {
        **{name: kind(branch_value(options, BRANCH_NAMES[name], kind())) for name, kind in carried.items()},
        "moe_top_k": 2,
        "moe_normalize_gate": True,
        "moe_capacity_factor": 1.0,
        "moe_gating_use_fp32": True,
        "moe_batch_major_routing": True,
        "moe_normalize_gate_after_dropping": after,
        "moe_second_expert_policy": policy,
    }
    freq = int(branch_value(options, "moe_freq", 0))
    for side in layers:
        flags[f"{side}_moe_freq"] = max(int(branch_value(options, f"{side}_moe_freq", 0)), freq)
    flags["moe_freq"] = freq or max(flags[f"{side}_moe_freq"] for side in layers)
    fraction = float(branch_value(options, "moe_eval_capacity_token_fraction", 0.25))
    if not math.isfinite(fraction):
        raise CheckpointSetError(f"{path} has --moe-eval-capacity-token-fraction {fraction}: not a number of slots")
    if fraction > 0.0:
        flags["moe_eval_capacity_token_fraction"] = fraction  # ceil(f * S), pads counted, as the branch
        flags["moe_eval_capacity_factor"] = 0.0
    else:
        flags["moe_eval_capacity_factor"] = 1.0
        notes.append(
            "--moe-eval-capacity-token-fraction <= 0: evaluation used the training capacity 2*ceil(S/E); "
            "imported as --moe-eval-capacity-factor 1 (the same count, but S here excludes pad tokens)"
        )
    if policy != "all":
        notes.append(
            f"--moe-second-expert-policy {policy}: the second expert is drawn at random, in evaluation too "
            f"(as the branch does): generation differs from run to run unless torch is seeded"
        )
    if not branch_value(options, "moe_gating_use_fp32", False):
        notes.append("the branch routed in the activation dtype (no --moe-gating-use-fp32); routing runs in fp32 here")
    if not branch_value(options, "use_moe_pad_mask", False):
        notes.append(
            "the branch routed pad tokens too (no --use-moe-pad-mask), where they took capacity; pad tokens "
            "are never routed here: identical outputs for real tokens wherever nothing is dropped"
        )
    eom = float(branch_value(options, "moe_eom", 0.0))
    if eom:
        flags["moe_eom"] = eom  # Expert Output Masking: the same per-slot mask and 1 - p scaling here
    # The branch divides expert gradients by sqrt(W / replicas) for these names, else by W / replicas.
    if str(branch_value(options, "moe_normalize_expert_grad", "world_size")) in ("sqrt_world_size", "sqrt_num_experts"):
        flags["moe_normalize_expert_grad"] = "sqrt_world_size"
    notes.append(
        "training only: --moe-local-drop is not reproduced; dropout after the MoE block is fairseq's --dropout "
        "here (the branch applied it inside each expert)"
    )
    return flags, notes
