"""transformers' NLLB-MoE converter, the code that wrote the hub's ``facebook/nllb-moe-54b``, run on a tiny set in
the fairseq ``nllb`` branch's layout: the hub's layout as its producer writes it.

Where the script comes from. ``convert_nllb_moe_sharded_original_checkpoint_to_pytorch.py`` ships in
transformers' wheels from 4.28.1 to 4.47.1, the same bytes in each (md5 89f37a69dc8f2a15adcf1977ad4d0910), and
in neither the wheel nor the sdist of the pinned 4.57.1. recipes/lib/venv.sh takes that one file out of the
4.47.1 wheel (tests/requirements-converter.txt) into ``<venv>/oracles/nllb_moe_converter/``; it runs here with the
pinned transformers 4.57.1 (its imports: ``NllbMoeConfig``, ``NllbMoeModel``, two file names).

How it is run: its own ``__main__`` (``runpy``; its argparse given the two paths), with these changes and no other:

- its hard-coded sizes: ``NllbMoeConfig.from_pretrained("facebook/nllb-200-3.3B", encoder_sparse_step=4,
  decoder_sparse_step=4, num_experts=128)`` (a download of the dense 3.3B's config, with the 54B's MoE sizes)
  answers with the tiny model's config; its loop over ``-rank-{0..127}.pt`` reads the E rank files there are;
- ``save_pretrained``'s defaults of transformers 4.28, which wrote the hub's copy (March 2023): ``.bin`` shards
  (4.57.1 writes safetensors) of at most ``max_shard_size`` (4.28: 10 GB, the hub's 23 shards; here a few KB, so
  that the tiny model spans many shards with some experts of a layer in each);
- ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``: the script calls ``torch.load`` without ``weights_only``, which torch >=
  2.6 refuses for the branch's pickles (an argparse Namespace); torch's own advice for a trusted file;
- ``transformers.modeling_utils.dtype_byte_size``, which the script imports and 4.57.1 no longer has: a dtype's
  bytes per element, used for the index's ``total_size`` only.
"""

import os
import runpy
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch

CONVERTER = (
    Path(sys.prefix) / "oracles" / "nllb_moe_converter" / "convert_nllb_moe_sharded_original_checkpoint_to_pytorch.py"
)
DENSE_CONFIG = "facebook/nllb-200-3.3B"  # what the script asks the hub for


def needs_converter():
    if not CONVERTER.is_file():
        pytest.skip(f"transformers' NLLB-MoE converter (tests/requirements-converter.txt) is not in {CONVERTER.parent}")


@contextmanager
def _environment(name, value):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def convert(prefix: Path, out: Path, config, max_shard_size: str = "20KB") -> Path:
    """Run the converter on the branch set ``prefix`` (``-shared.pt``, ``-rank-<r>.pt`` with one expert each under
    local number 0) into ``out``, ``config`` (an ``NllbMoeConfig``) standing for the hub's dense config; returns
    ``out``: ``config.json`` (``NllbMoeModel``), ``pytorch_model-000NN-of-000MM.bin``, ``pytorch_model.bin.index.json``."""
    needs_converter()
    import transformers
    import transformers.modeling_utils as modeling_utils
    from transformers import NllbMoeConfig

    real_config, real_save = NllbMoeConfig.from_pretrained, modeling_utils.PreTrainedModel.save_pretrained

    def from_pretrained(name, *args, **kwargs):
        return config if name == DENSE_CONFIG else real_config(name, *args, **kwargs)

    def save_pretrained(self, directory, *args, **kwargs):
        kwargs.setdefault("safe_serialization", False)
        kwargs.setdefault("max_shard_size", max_shard_size)
        return real_save(self, directory, *args, **kwargs)

    argv = [str(CONVERTER), "--nllb_moe_checkpoint_path", str(prefix), "--pytorch_dump_folder_path", str(out)]
    with (
        mock.patch.object(NllbMoeConfig, "from_pretrained", from_pretrained),
        mock.patch.object(transformers.PreTrainedModel, "save_pretrained", save_pretrained),
        mock.patch.object(
            modeling_utils, "dtype_byte_size", lambda d: torch.empty(0, dtype=d).element_size(), create=True
        ),
        mock.patch.object(sys, "argv", argv),
        _environment("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1"),
    ):
        runpy.run_path(str(CONVERTER), run_name="__main__")
    return out
