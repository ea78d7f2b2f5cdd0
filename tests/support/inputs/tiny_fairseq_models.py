"""Models built the way fairseq-train builds them (flags through fairseq's parser, its config, torch
seeded with --seed, ``task.build_model``) on a directory of dictionaries only (tests/fairseq/conftest.py's
``data``), and batches collated from random tokens."""

from collections import namedtuple

import torch
from fairseq import options, tasks, utils
from fairseq.data import LanguagePairDataset
from fairseq.data.data_utils import collate_tokens
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

from fairseq_helpers import USER_DIR

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
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    utils.set_torch_seed(cfg.common.seed)
    return cfg


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
