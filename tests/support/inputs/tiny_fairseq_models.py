"""Models built the way fairseq-train builds them (flags through fairseq's parser, its config, torch
seeded with --seed, ``task.build_model``) on a directory of dictionaries only (tests/fairseq/conftest.py's
``data``), and batches collated from random tokens."""

import contextlib
import copy
from collections import namedtuple

import torch
from fairseq.data import LanguagePairDataset
from fairseq.data.data_utils import collate_tokens
from fairseq.dataclass import utils as dataclass_utils
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import flag_override

from fairseq import options, tasks, utils
from support.launch.fairseq_helpers import USER_DIR

Built = namedtuple("Built", "task model criterion")


def tiny_model_flags(data, task, arch, *flags, seed=1):
    """fairseq-train's command line for ``arch`` on ``task`` with this plugin, on the CPU, without dropout."""
    # fmt: off
    return [str(data), "--user-dir", USER_DIR, "--task", task, "--arch", arch, "--cpu", "--seed", str(seed),
            "--dropout", "0", "--attention-dropout", "0", *flags]
    # fmt: on


def train_config(argv):
    """fairseq-train's config for its command line ``argv``, with torch seeded by its --seed: what
    fairseq_cli.train does right before building the model."""
    cfg = converted(options.parse_args_and_arch(options.get_training_parser(), argv))
    utils.set_torch_seed(cfg.common.seed)
    return cfg


# fairseq's convert_namespace_to_omegaconf hands hydra one override per field of every option group (about
# 250), and hydra composes them all anew each time (0.3 s of CPU). For overrides with the same keys and
# group choices as a composition seen before, converted() runs fairseq's function with hydra's composition
# replaced by hydra's own _apply_overrides_to_config of only the overrides that differ, on a copy of that
# composition: each is one assignment, whatever was assigned before. Anything else (a dict value, which
# hydra merges; an override hydra refuses) goes through hydra's whole composition.
# tests/fairseq/test_tiny_model_configs.py checks configs composed so against fairseq's own.
_COMPOSED = {}  # (keys, group choices) -> (hydra's composition, its overrides, config name, strict)


class _NotAlike(Exception):
    pass


def _composition_key(overrides):
    keys = tuple(o.split("=", 1)[0] for o in overrides)
    return keys, tuple(o for o, k in zip(overrides, keys) if "." not in k)


@contextlib.contextmanager
def _fairseq_composing_with(compose, initialize=None):
    kept = dataclass_utils.compose, dataclass_utils.initialize
    dataclass_utils.compose, dataclass_utils.initialize = compose, initialize or kept[1]
    try:
        yield kept[0]
    finally:
        dataclass_utils.compose, dataclass_utils.initialize = kept


def _recompose(config_name, overrides, strict=None):
    base, applied, name, was_strict = _COMPOSED[_composition_key(overrides)]
    changed = OverridesParser.create().parse_overrides([o for o, a in zip(overrides, applied) if o != a])
    if (config_name, strict) != (name, was_strict) or any(
        o.is_delete() or o.is_add() or o.is_force_add() or isinstance(o.value(), dict) for o in changed
    ):
        raise _NotAlike
    cfg = copy.deepcopy(base)
    try:
        with flag_override(cfg, "struct", True):  # as hydra applies them, before compose(strict=...)
            ConfigLoaderImpl._apply_overrides_to_config(changed, cfg)
    except Exception as refused:  # hydra's whole composition says what is wrong
        raise _NotAlike from refused
    return cfg


def converted(args):
    """fairseq's convert_namespace_to_omegaconf(args), composed from an alike composition where there is one
    (without hydra's initialize either, whose search of the call stack costs about as much)."""
    if _composition_key(dataclass_utils.override_module_args(args)[0]) in _COMPOSED:
        with contextlib.suppress(_NotAlike), _fairseq_composing_with(_recompose, lambda **_: contextlib.nullcontext()):
            return dataclass_utils.convert_namespace_to_omegaconf(args)

    def composing_and_keeping(config_name, overrides, strict=None):
        cfg = compose(config_name, overrides=overrides, strict=strict)
        _COMPOSED[_composition_key(overrides)] = (copy.deepcopy(cfg), list(overrides), config_name, strict)
        return cfg

    with _fairseq_composing_with(composing_and_keeping) as compose:
        return dataclass_utils.convert_namespace_to_omegaconf(args)


def build(data, task, arch, *flags, seed=1):
    cfg = train_config(tiny_model_flags(data, task, arch, *flags, seed=seed))
    built_task = tasks.setup_task(cfg.task)
    return Built(built_task, built_task.build_model(cfg.model), built_task.build_criterion(cfg.criterion))


def translation(data, *flags, arch="moe_transformer_tiny", **kw):
    return build(data, "translation", arch, "--source-lang", "src", "--target-lang", "tgt", *flags, **kw)


def language_model(data, *flags, arch="moe_transformer_lm_tiny", **kw):
    return build(data, "language_modeling", arch, *flags, **kw)


def random_sentences(dictionary, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(dictionary.nspecial, len(dictionary), (n,), generator=g) for n in lengths]


def translation_batch(task, seed=0, lengths=(7, 3, 5, 9)):
    """Sentences of different lengths, so both sides carry padding."""
    eos = task.src_dict.eos()
    src = [torch.cat([s, torch.tensor([eos])]) for s in random_sentences(task.src_dict, lengths, seed)]
    tgt = [torch.cat([s, torch.tensor([eos])]) for s in random_sentences(task.tgt_dict, lengths[::-1], seed + 1)]
    dataset = LanguagePairDataset(
        src,
        [len(s) for s in src],
        task.src_dict,
        tgt,
        [len(t) for t in tgt],
        task.tgt_dict,
    )
    return dataset.collater([dataset[i] for i in range(len(src))])


def lm_batch(task, seed=0, lengths=(9, 4, 6)):
    d = task.dictionary
    sentences = random_sentences(d, lengths, seed)
    target = collate_tokens([s[1:] for s in sentences], d.pad())
    return {
        "id": torch.arange(len(sentences)),
        "nsentences": len(sentences),
        "ntokens": int(target.ne(d.pad()).sum()),
        "target": target,
        "net_input": {
            "src_tokens": collate_tokens([s[:-1] for s in sentences], d.pad()),
            "src_lengths": torch.tensor([len(s) - 1 for s in sentences]),
        },
    }
