"""Tiny random Hugging Face ``NllbMoeForConditionalGeneration`` models (transformers 4.57.1, the oracle) and
their weights written in the fairseq ``nllb`` branch's file layout, with a matching fairseq dictionary.

The layout is the inverse of transformers' own
``convert_nllb_moe_sharded_original_checkpoint_to_pytorch.py`` (read for the key names, not copied):
HF ``model.<side>.layers.<i>.ffn.router.classifier`` is the branch's ``<side>.layers.<i>.moe_layer.gate.wg``,
``ffn.experts.expert_<j>`` its ``moe_layer.experts.<j>`` (global j here; ``branch_sets.write_branch_parts``
numbers them locally per rank file), a dense layer's ``ffn.fc1|fc2`` its ``fc1|fc2``, ``cross_attention`` its
``encoder_attn`` and ``ff_layer_norm`` its ``final_layer_norm``. The embeddings are shared (NLLB's
``--share-all-embeddings``): HF's ``shared``, the two ``embed_tokens`` and ``lm_head`` are one matrix, the branch's
``encoder.embed_tokens``, ``decoder.embed_tokens`` and ``decoder.output_projection``. The sinusoidal positions are
computed, not stored: the branch file holds fairseq's ``_float_tensor`` placeholders and ``version`` buffers.
fairseq's special ids (bos 0, pad 1, eos 2, unk 3) are HF NLLB's too, so token ids need no mapping.
"""

import argparse
import importlib.util
import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

from support.inputs.branch_sets import BRANCH_MOE_OPTIONS, write_branch_parts

VOCAB = 48
D_MODEL = 16
FFN = 32
LAYERS = 3  # a side; with sparse step 2, layer 1 of each side is MoE
EXPERTS = 4
HEADS = 2
MAX_POSITIONS = 64
EOM = 0.2

PAD, EOS = 1, 2
# The marks of a module of in-process oracle tests: skipped where transformers is absent (found without
# importing it at collection), and kept on one pytest-xdist worker, so that one worker alone imports it.
# fmt: off
NEEDS_TRANSFORMERS = [
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="transformers (tests/requirements-oracle.txt) is not installed: bash tests/run.sh installs it"),
    pytest.mark.xdist_group("transformers"),
]
# fmt: on
TOLERANCE = dict(atol=1e-5, rtol=0)  # fp32, eval: measured differences are below 1e-6
EXPERT = re.compile(r"^(?P<layer>.*)\.ffn\.experts\.expert_(?P<id>\d+)\.(?P<name>fc[12]\.(weight|bias))$")
# fmt: off
RENAMES = ((".ffn.router.classifier.", ".moe_layer.gate.wg."), (".ffn.fc1.", ".fc1."), (".ffn.fc2.", ".fc2."),
           (".cross_attention_layer_norm.", ".encoder_attn_layer_norm."), (".cross_attention.", ".encoder_attn."),
           (".ff_layer_norm.", ".final_layer_norm."))
# fmt: on


def hf_config(**changes):
    from transformers import NllbMoeConfig

    options = dict(
        vocab_size=VOCAB,
        d_model=D_MODEL,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        num_experts=EXPERTS,
        encoder_sparse_step=2,
        decoder_sparse_step=2,
        moe_token_dropout=EOM,
        router_dtype="float32",
        second_expert_policy="all",
        normalize_router_prob_before_dropping=False,
        batch_prioritized_routing=False,
        moe_eval_capacity_token_fraction=1.0,
        expert_capacity=None,
        max_position_embeddings=MAX_POSITIONS,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        scale_embedding=True,
        attn_implementation="eager",
    )
    options.update(changes)
    return NllbMoeConfig(**options)


def hf_model(seed: int = 2, **changes):
    """A random tiny model in eval mode. Weights are drawn wider than HF's init (std 0.02) so that routers
    prefer experts clearly and every expert, layer norm and bias changes the output measurably."""
    from transformers import NllbMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = NllbMoeForConditionalGeneration(hf_config(**changes))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.5 if "router" in name else 0.2) * torch.randn(p.shape, generator=g))
    return model.eval()


def branch_state(model) -> Tuple[Dict[str, torch.Tensor], Dict[Tuple[str, str], List[torch.Tensor]]]:
    """(the branch's shared state, {(layer, "fc1.weight" ...): [global expert 0, 1, ...]}) from an HF model."""
    shared, experts = {}, {}
    for key, tensor in model.state_dict().items():
        if key in ("lm_head.weight", "model.shared.weight") or key.endswith("embed_tokens.weight"):
            continue
        key = key[len("model.") :]
        match = EXPERT.match(key)
        if match:
            # write_branch_parts names it <layer>.moe_layer.experts.<local j>.<name>
            experts.setdefault((match["layer"], match["name"]), {})[int(match["id"])] = tensor.clone()
            continue
        for old, new in RENAMES:
            key = key.replace(old, new)
        shared[key] = tensor.clone()
    embeddings = model.model.shared.weight.detach().clone()
    for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "decoder.output_projection.weight"):
        shared[key] = embeddings
    for side in ("encoder", "decoder"):
        shared[f"{side}.embed_positions._float_tensor"] = torch.FloatTensor(1)
        shared[f"{side}.version"] = torch.Tensor([3])
    experts = {key: [by_id[j] for j in sorted(by_id)] for key, by_id in experts.items()}
    return shared, experts


def write_dictionary(directory: Path) -> Path:
    """dict.src.txt and dict.tgt.txt (one joined dictionary, as NLLB's): fairseq adds <s> <pad> </s> <unk>
    as ids 0-3, then these symbols as ids 4 ... VOCAB - 1."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"w{i} 1\n" for i in range(4, VOCAB))
    for side in ("src", "tgt"):
        (directory / f"dict.{side}.txt").write_text(lines)
    return directory


def branch_options(data: Path, **moe) -> argparse.Namespace:
    """The model options the branch's fairseq-train stores for this HF config: ``arch transformer`` with
    pre-norm, shared embeddings, ReLU, no dropout, and the branch's MoE options (``moe`` overrides)."""
    from fairseq import options

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        [
            str(data),
            "--task",
            "translation",
            "--arch",
            "transformer",
            "--source-lang",
            "src",
            "--target-lang",
            "tgt",
            "--encoder-embed-dim",
            str(D_MODEL),
            "--decoder-embed-dim",
            str(D_MODEL),
            "--encoder-ffn-embed-dim",
            str(FFN),
            "--decoder-ffn-embed-dim",
            str(FFN),
            "--encoder-layers",
            str(LAYERS),
            "--decoder-layers",
            str(LAYERS),
            "--encoder-attention-heads",
            str(HEADS),
            "--decoder-attention-heads",
            str(HEADS),
            "--encoder-normalize-before",
            "--decoder-normalize-before",
            "--share-all-embeddings",
            "--dropout",
            "0",
            "--attention-dropout",
            "0",
            "--activation-dropout",
            "0",
            "--max-source-positions",
            str(MAX_POSITIONS),
            "--max-target-positions",
            str(MAX_POSITIONS),
            "--cpu",
        ],
    )
    values = dict(vars(args), **BRANCH_MOE_OPTIONS)
    values.update(
        moe_expert_count=EXPERTS,
        moe_freq=2,
        moe_eom=EOM,
        moe_eval_capacity_token_fraction=1.0,
        moe_second_expert_policy="all",
        moe_normalize_gate_prob_before_dropping=False,
    )
    values.update(moe)
    return argparse.Namespace(**values)


def oracle_task(directory: Path):
    """fairseq's translation task on this file's dictionary (``task.data_dir`` is where it lies)."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq import options, tasks
    from support.launch.fairseq_helpers import translation_flags

    data = write_dictionary(directory)
    args = options.parse_args_and_arch(
        options.get_training_parser(), [*translation_flags(data, "transformer"), "--cpu"]
    )
    built = tasks.setup_task(convert_namespace_to_omegaconf(args).task)
    built.data_dir = data
    return built


def batch(lengths, target_lengths=None, seed=0):
    """Source left-padded and target right-padded, as fairseq collates them; eos ends every source and
    starts every decoder input (NLLB's decoder_start_token_id is eos)."""
    g = torch.Generator().manual_seed(seed)
    target_lengths = target_lengths or lengths
    src = torch.full((len(lengths), max(lengths)), PAD)
    tgt = torch.full((len(lengths), max(target_lengths)), PAD)
    for row, (n, m) in enumerate(zip(lengths, target_lengths)):
        src[row, src.shape[1] - n :] = torch.cat([torch.randint(4, VOCAB, (n - 1,), generator=g), torch.tensor([EOS])])
        tgt[row, :m] = torch.cat([torch.tensor([EOS]), torch.randint(4, VOCAB, (m - 1,), generator=g)])
    return src, tgt


def import_hf(tmp_path, task, hf, ranks=2, world=1, **branch_moe):
    """hf -> the branch's layout (``ranks`` rank files) -> import-fairseq-moe (``world`` output files) ->
    fairseq's load_model_ensemble, in eval; returns (model, what the import printed)."""
    shared, experts = branch_state(hf)
    prefix = write_branch_parts(
        tmp_path / "nllb" / "checkpoint_2_300000", shared, experts, branch_options(task.data_dir, **branch_moe), ranks
    )
    from fairseq import checkpoint_utils
    from fairseq_moe_ext.checkpoint.branch import importer as branch_import

    lines = []
    branch_import.import_branch_set(str(prefix), str(tmp_path / "imported.pt"), world, report=lines.append)
    models, _ = checkpoint_utils.load_model_ensemble([str(tmp_path / "imported.pt")], task=task)
    return models[0].eval(), "\n".join(lines)


def outputs_of_both(model, hf, src, tgt):
    """(ours, HF's) encoder outputs [B, S, C] and logits [B, T, V], pad positions zeroed in both."""
    with torch.no_grad():
        lengths = src.ne(PAD).sum(1)
        encoder = model.encoder(src, lengths)["encoder_out"][0].transpose(0, 1)
        logits = model(src, lengths, tgt)[0]
        theirs = hf(
            input_ids=src,
            attention_mask=src.ne(PAD).long(),
            decoder_input_ids=tgt,
            decoder_attention_mask=tgt.ne(PAD).long(),
        )
    real_src, real_tgt = src.ne(PAD).unsqueeze(-1), tgt.ne(PAD).unsqueeze(-1)
    return (
        (encoder * real_src, logits * real_tgt),
        (theirs.encoder_last_hidden_state * real_src, theirs.logits * real_tgt),
    )


def assert_same_as_hf(model, hf, src, tgt):
    (encoder, logits), (hf_encoder, hf_logits) = outputs_of_both(model, hf, src, tgt)
    torch.testing.assert_close(encoder, hf_encoder, **TOLERANCE)
    torch.testing.assert_close(logits, hf_logits, **TOLERANCE)


class TorchWithoutLayerdropDraws:
    """HF's encoder and decoder draw ``torch.rand([])`` before every layer for layerdrop, in evaluation too (it
    only skips layers in training): that shifts the generator between its routers' draws. This stands in for
    ``torch`` in HF's module and answers those draws with 1 (never below layerdrop 0) without the generator."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def rand(self, *args, **kwargs):
        return self._real.ones([]) if args == ([],) else self._real.rand(*args, **kwargs)
