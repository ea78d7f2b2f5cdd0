"""The configs of tests/support/tiny_fairseq_models.train_config, which composes a command line's config
from an alike composition (same option groups, other values) instead of running hydra's whole
composition again, equal fairseq's own ``convert_namespace_to_omegaconf`` for every kind of value."""

import pytest
from fairseq.dataclass import utils as dataclass_utils
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from hydra.experimental import compose
from omegaconf import OmegaConf

from fairseq import options
from support.inputs import tiny_fairseq_models
from support.inputs.tiny_fairseq_models import tiny_model_flags, train_config

pytestmark = pytest.mark.filterwarnings("ignore:\\s*'config' is validated against ConfigStore schema")


def fairseqs_own(argv):
    return convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))


def typed(cfg):
    """Every value with its type (1, 1.0 and True are equal in Python, not in a config)."""
    return repr(OmegaConf.to_container(cfg)), OmegaConf.is_struct(cfg), OmegaConf.is_readonly(cfg)


def test_a_config_composed_from_an_alike_one_equals_fairseqs_own_conversion(data, monkeypatch):
    monkeypatch.setattr(tiny_fairseq_models, "_COMPOSED", {})
    hydras = []  # the command lines hydra composed whole
    monkeypatch.setattr(dataclass_utils, "compose", lambda *a, **kw: hydras.append(1) or compose(*a, **kw))
    flags = lambda *more: tiny_model_flags(data, "translation", "moe_transformer_tiny", "--source-lang", "src",
                                           "--target-lang", "tgt", "--optimizer", "adam", *more)  # fmt: skip
    first = flags("--max-tokens", "300", "--lr", "0.5")
    # Each changes values of every kind from the first: int, float, float list, a str with quotes and
    # braces, true (a store_true flag), a tuple, null (--max-tokens left out) and null to int.
    # fmt: off
    alike = [
        flags("--max-tokens", "300", "--lr", "0.25,0.125", "--moe-expert-count", "8", "--moe-freq", "1", "--seed", "7"),
        flags("--max-tokens", "300", "--eval-bleu-args", '{"beam": 4, "it\'s": "x"}', "--moe-deterministic"),
        flags("--adam-betas", "(0.8, 0.9)", "--moe-top-k", "1", "--batch-size", "4"),
    ]
    # fmt: on
    assert typed(train_config(first)) == typed(fairseqs_own(first))
    for argv in alike:
        assert typed(train_config(argv)) == typed(fairseqs_own(argv)), argv
    assert len(hydras) == 1 + 1 + len(alike), "an alike command line was composed whole, not from the first"
