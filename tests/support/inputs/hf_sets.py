"""Tiny translation sets NllbMoe can express, written the way this plugin writes them, for the
export-hf / import-hf tests (tests/interop/test_hf_exchange.py, test_hf_bad_input.py).

The model is built through fairseq's parser and ``task.build_model`` (as fairseq-train builds it), its
parameters moved off their initial values (so biases and layer norms matter), and saved as a single
file or, through the checkpoint tool's own ``save_set``, as a W-file set (experts spread over the
rank files, the format training writes)."""

from pathlib import Path

import torch
from fairseq.data import Dictionary

from fairseq import options, tasks, utils
from fairseq_moe_ext import checkpoint as moe_ckpt
from support.inputs.tiny_fairseq_models import converted, tiny_model_flags

EXPERTS = 4
# What NllbMoe can express: top-2, gates renormalised, dropless evaluation (fraction 1.0), NllbMoe's
# training capacity, pre-norm, one shared embedding table; a dense and a sparse layer on each side.
# fmt: off
HF_FLAGS = ["--share-all-embeddings", "--encoder-normalize-before", "--decoder-normalize-before",
            "--moe-normalize-gate", "--moe-capacity-factor", "1", "--moe-eval-capacity-factor", "0",
            "--moe-expert-count", str(EXPERTS), "--moe-freq", "2", "--moe-eom", "0.2",
            "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
            "--encoder-ffn-embed-dim", "48", "--decoder-ffn-embed-dim", "48"]
# fmt: on


def joined_data(root: Path, symbols: int = 20) -> Path:
    """Dictionaries only, one for both languages (--share-all-embeddings needs a joined one)."""
    dictionary = Dictionary()
    for i in range(symbols):
        dictionary.add_symbol(f"w{i}")
    for name in ("dict.src.txt", "dict.tgt.txt", "dict.txt"):
        dictionary.save(str(root / name))
    return root


def parse(data: Path, *flags, arch="moe_transformer_tiny", task="translation"):
    languages = ["--source-lang", "src", "--target-lang", "tgt"] if task == "translation" else []
    return options.parse_args_and_arch(
        options.get_training_parser(), tiny_model_flags(data, task, arch, *languages, *flags)
    )


def build(data: Path, *flags, arch="moe_transformer_tiny", task="translation", seed=1):
    """(args, task, model in eval) with every parameter moved by a seeded random step."""
    args = parse(data, *flags, arch=arch, task=task)
    cfg = converted(args)
    utils.set_torch_seed(seed)
    built_task = tasks.setup_task(cfg.task)
    model = built_task.build_model(cfg.model).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return args, built_task, model


def write_set(args, model, name: Path, world: int = 1) -> Path:
    """The model as this plugin's checkpoint ``name`` (``<dir>/<stem>.pt``): one file, or ``world`` rank files
    and a manifest. Returns the name to pass to the checkpoint tool."""
    state = model.state_dict()
    keys = [k for k in state if ".fc1.experts." in k]
    experts = int(state[keys[0]].shape[0])
    full = {
        "args": args,
        "model": state,
        "extra_state": {},
        "task_state": {},
        "optimizer_history": [
            {
                "criterion_name": "CrossEntropyCriterion",
                "optimizer_name": "none",
                "lr_scheduler_state": {"best": None},
                "num_updates": 0,
            }
        ],
        "moe": moe_ckpt.moe_metadata([], keys, 1, 0, 0, experts_per_worker=experts),
    }
    name.parent.mkdir(parents=True, exist_ok=True)
    if world == 1:
        torch.save(full, name)
    else:
        moe_ckpt.save_set(full, str(name.with_suffix("")), world)
    return name


def batch(seed: int = 0, vocab: int = 24, sentences: int = 3, source: int = 7, target: int = 5):
    """(src_tokens, src_lengths, prev_output_tokens): no padding, the decoder input starting at </s> (2)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (sentences, source), generator=g)
    src[:, -1] = 2
    prev = torch.randint(4, vocab, (sentences, target), generator=g)
    prev[:, 0] = 2
    return src, torch.full((sentences,), source), prev
