"""A set's model options as Hugging Face's ``NllbMoeConfig`` (``config.json``), and back.

NllbMoe's sparse block is the nllb branch's: a top-2 softmax router in fp32, the two gates renormalised to
sum to 1, each expert ``fc1 -> activation -> fc2``, Expert Output Masking as ``moe_token_dropout``
(evaluation multiplies expert outputs by 1 - p, as ``--moe-eom`` does); its second-expert policy,
normalisation order and evaluation capacity are mapped by ``routing.py``. Around it, a pre-norm
transformer with sinusoidal positions and one embedding table shared by both sides and the output projection.

What NllbMoe cannot express is refused in one line naming the option and the fix; what differs in
training only comes back as NOTE lines. Torch-free: plain dicts and Namespaces.
"""

import argparse
from typing import Dict, List, Tuple

from ...options import HF_NAMES, OPTIONS, expert_count, moe_options
from ...options.sides import sides_of
from ..errors import CheckpointSetError
from .fields import MODEL_TYPE, check_model_kind, check_numeric_fields
from .routing import exported_routing, imported_routing

# fmt: off
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_accurate": "gelu_new", "gelu_fast": "gelu_new",
               "tanh": "tanh", "linear": "linear", "swish": "silu"}
# fmt: on
# fmt: off
ACTIVATIONS_BACK = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_accurate", "gelu_pytorch_tanh": "gelu_accurate",
                    "tanh": "tanh", "linear": "linear", "silu": "swish", "swish": "swish"}
# fmt: on
# fairseq's Dictionary: <s> 0, <pad> 1, </s> 2, <unk> 3; the decoder starts from </s>, as NLLB's does.
BOS, PAD, EOS = 0, 1, 2
SIDES = ("encoder", "decoder")
# NllbMoeConfig's defaults (transformers 4.57.1): save_pretrained leaves out what equals them.
# fmt: off
HF_DEFAULTS = dict(max_position_embeddings=1024, encoder_layerdrop=0.05, decoder_layerdrop=0.05,
                   activation_function="relu", dropout=0.1, attention_dropout=0.1, activation_dropout=0.0,
                   decoder_start_token_id=2, scale_embedding=True, router_bias=False, router_dtype="float32",
                   router_ignore_padding_tokens=False, expert_capacity=64, encoder_sparse_step=4, decoder_sparse_step=4,
                   second_expert_policy="all", normalize_router_prob_before_dropping=False,
                   batch_prioritized_routing=False, moe_eval_capacity_token_fraction=1.0, moe_token_dropout=0.2,
                   pad_token_id=1, bos_token_id=0, eos_token_id=2, tie_word_embeddings=True)
# fmt: on


def _get(options, name, default=None):
    value = getattr(options, name, default) if not isinstance(options, dict) else options.get(name, default)
    return default if value is None else value


def _refuse(path, option, value, why, fix):
    raise CheckpointSetError(f"{path} has {option} {value}: {why}; {fix} (nothing was written)")


# (option, default, is it refused?, why NllbMoe cannot express it, fix)
# fmt: off
NOT_EXPRESSIBLE = (
    ("moe_top_k", 2, lambda v: int(v) != 2, "NllbMoe routes every token to exactly 2 experts", "export a top-2 model"),
    ("moe_router", "top", lambda v: str(v) != "top", "NllbMoe's router is a plain linear + softmax ('top')",
     "export a model trained with --moe-router top"),
    ("moe_shared_expert_count", 0, lambda v: int(v) > 0, "NllbMoe has no shared experts",
     "export a model without --moe-shared-expert-count"),
    ("moe_balance", "none", lambda v: str(v) != "none", "NllbMoe has no balance bias on its router",
     "export a model trained without --moe-balance bias"),
    ("moe_gating_no_fp32", False, bool, "NllbMoe's router_dtype float32 is what is exported",
     "export a model trained with fp32 routing (without --moe-gating-no-fp32)"),
    ("moe_capacity_factor", 0.0, lambda v: float(v) != 1.0,
     "NllbMoe trains with 2*ceil(S/E) slots per expert (expert_capacity unset), which is --moe-capacity-factor 1",
     "pass --training-as-nllb to export it for NllbMoe's training capacity (evaluation is unchanged)"),
    ("moe_gate_noise", 0.0, lambda v: float(v) > 0, "NllbMoe adds no noise to its router logits",
     "pass --training-as-nllb to export it without the noise (it acts in training only)"),
    ("share_all_embeddings", False, lambda v: not v,
     "NllbMoe has one embedding table for the encoder, the decoder and the output projection",
     "export a model trained with --share-all-embeddings (a joined dictionary)"),
    ("encoder_normalize_before", False, lambda v: not v, "NllbMoe's encoder layers are pre-norm",
     "export a model trained with --encoder-normalize-before"),
    ("decoder_normalize_before", False, lambda v: not v, "NllbMoe's decoder layers are pre-norm",
     "export a model trained with --decoder-normalize-before"),
    ("encoder_learned_pos", False, bool, "NllbMoe's positions are sinusoidal",
     "export a model with sinusoidal positions"),
    ("decoder_learned_pos", False, bool, "NllbMoe's positions are sinusoidal",
     "export a model with sinusoidal positions"),
    ("no_token_positional_embeddings", False, bool, "NllbMoe always adds positions",
     "export a model with positional embeddings"),
    ("layernorm_embedding", False, bool, "NllbMoe has no layer norm on its embeddings",
     "export a model without --layernorm-embedding"),
    ("adaptive_input", False, bool, "NllbMoe has plain embeddings", "export a model without --adaptive-input"),
    ("adaptive_softmax_cutoff", None, lambda v: v is not None, "NllbMoe's output is one linear layer",
     "export a model without --adaptive-softmax-cutoff"),
    ("cross_self_attention", False, bool, "NllbMoe's decoder attends to the encoder in a separate cross attention",
     "export a model without --cross-self-attention"),
    ("no_cross_attention", False, bool, "NllbMoe's decoder has cross attention", "export an encoder-decoder model"),
    ("no_decoder_final_norm", False, bool, "NllbMoe's decoder ends in a layer norm",
     "export a model without --no-decoder-final-norm"),
    ("quant_noise_pq", 0, lambda v: float(v) > 0, "NllbMoe has no quantization noise", "export a model without it"),
    ("encoder_layers_to_keep", None, lambda v: v is not None, "NllbMoe keeps every layer",
     "export a model without --encoder-layers-to-keep"),
    ("decoder_layers_to_keep", None, lambda v: v is not None, "NllbMoe keeps every layer",
     "export a model without --decoder-layers-to-keep"),
)
# fmt: on


# Options that act in training only: --training-as-nllb exports a set trained with them, with a NOTE.
TRAINING_ONLY = ("moe_capacity_factor", "moe_gate_noise")


def hf_config(options, path: str, vocab: int, dtype: str, training_as_nllb: bool = False) -> Tuple[Dict, List[str]]:
    """(``config.json`` as a dict, NOTE lines) for a translation set's model ``options``; with
    ``training_as_nllb`` the training-only options NllbMoe lacks are noted instead of refused."""
    arch = str(_get(options, "arch", _get(options, "_name", "")))
    if "lm" in arch.split("_") or _get(options, "encoder_layers") is None:
        raise CheckpointSetError(
            f"{path} is a {arch!r} language model: export-hf writes translation models "
            f"(NllbMoeForConditionalGeneration), which have an encoder (nothing was written)"
        )
    experts = {side: expert_count(options, side) for side in SIDES}
    if experts["encoder"] != experts["decoder"]:
        _refuse(
            path,
            "--encoder-moe-expert-count",
            f"{experts['encoder']} and --decoder-moe-expert-count {experts['decoder']}",
            "NllbMoe has one num_experts for every sparse layer",
            "export a set with the same number of experts on both sides (prune without --encoder-decoder-ratio)",
        )
    notes = []
    for name, default, refused, why, fix in NOT_EXPRESSIBLE:
        value = _get(options, name, default)
        if refused(value) and training_as_nllb and name in TRAINING_ONLY:
            notes.append(
                f"--{name.replace('_', '-')} {value}: {why}; exported for NllbMoe's training "
                f"(--training-as-nllb), which changes nothing in evaluation"
            )
        elif refused(value):
            _refuse(path, "--" + name.replace("_", "-"), value, why, fix)
    d_model = int(_get(options, "encoder_embed_dim"))
    for name in ("decoder_embed_dim", "decoder_input_dim", "decoder_output_dim"):
        if int(_get(options, name, d_model)) != d_model:
            _refuse(
                path,
                "--" + name.replace("_", "-"),
                _get(options, name),
                f"NllbMoe has one width d_model (--encoder-embed-dim {d_model}) everywhere",
                "export a model whose widths are all equal",
            )
    activation = str(_get(options, "activation_fn", "relu"))
    if activation not in ACTIVATIONS:
        _refuse(
            path,
            "--activation-fn",
            activation,
            "NllbMoe has no such activation",
            f"export a model with one of {', '.join(ACTIVATIONS)}",
        )
    values = moe_options(options)
    steps = {side.name: side.moe_freq for side in sides_of(options, SIDES)}
    ffn = {side: int(_get(options, f"{side}_ffn_embed_dim")) for side in SIDES}
    expert_dim = values.moe_expert_ffn_dim
    for side in SIDES:
        dense = [
            i
            for i in range(int(_get(options, f"{side}_layers")))
            if not (steps[side] > 0 and (i + 1) % steps[side] == 0)
        ]
        if expert_dim is not None and int(expert_dim) != ffn[side]:
            if dense:
                _refuse(
                    path,
                    "--moe-expert-ffn-dim",
                    expert_dim,
                    f"NllbMoe's experts and dense blocks share one {side}_ffn_dim, and {side} layer {dense[0]} "
                    f"is dense with --{side}-ffn-embed-dim {ffn[side]}",
                    "export a model whose expert and dense hidden sizes are equal",
                )
            ffn[side] = int(expert_dim)
    routing, routing_notes = exported_routing(options, path)  # policy, normalisation order, eval capacity
    notes += routing_notes
    eom = float(values.moe_eom or 0.0)
    if eom:
        notes.append(
            f"--moe-eom {eom:g} -> moe_token_dropout {eom:g}: the same in evaluation (outputs times 1 - p); "
            f"NllbMoe trains with element-wise dropout instead of masking whole expert outputs"
        )
    config = {
        "model_type": MODEL_TYPE,
        "architectures": ["NllbMoeForConditionalGeneration"],
        "torch_dtype": dtype,
        "vocab_size": vocab,
        "d_model": d_model,
        "max_position_embeddings": max(
            int(_get(options, "max_source_positions", 1024)), int(_get(options, "max_target_positions", 1024))
        ),
        "scale_embedding": not _get(options, "no_scale_embedding", False),
        "activation_function": ACTIVATIONS[activation],
        "dropout": float(_get(options, "dropout", 0.1)),
        "attention_dropout": float(_get(options, "attention_dropout", 0.0)),
        "activation_dropout": float(_get(options, "activation_dropout", 0.0) or _get(options, "relu_dropout", 0.0)),
        **{hf: OPTIONS[name].type(OPTIONS[name].read(options)) for name, hf in HF_NAMES.items()},
        "num_experts": experts["encoder"],  # --moe-expert-count, or both sides' own (equal) counts
        "expert_capacity": None,
        "router_bias": False,
        "router_dtype": "float32",
        "router_ignore_padding_tokens": False,
        **routing,
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "decoder_start_token_id": EOS,
        "is_encoder_decoder": True,
        "tie_word_embeddings": True,
        "use_cache": True,
    }
    for side in SIDES:
        config[f"{side}_layers"] = int(_get(options, f"{side}_layers"))
        config[f"{side}_attention_heads"] = int(_get(options, f"{side}_attention_heads"))
        config[f"{side}_ffn_dim"] = ffn[side]
        config[f"{side}_sparse_step"] = steps[side]
        config[f"{side}_layerdrop"] = float(_get(options, f"{side}_layerdrop", 0.0))
    return config, notes


def _need(config, path, name, wanted, why, fix):
    value = config.get(name)
    if value != wanted:
        raise CheckpointSetError(
            f"{path}: {name} is {value!r} ({why}), which this project cannot represent; {fix} (nothing was written)"
        )


def imported_options(config: Dict, path: str) -> Tuple[argparse.Namespace, List[str]]:
    """(``moe_transformer`` model options, NOTE lines) for an NllbMoe ``config.json``."""
    check_model_kind(config, path)
    check_numeric_fields(config, path)
    config = {**HF_DEFAULTS, **config}
    _need(config, path, "router_bias", False, "a bias on the router", "there is none here")
    _need(
        config,
        path,
        "tie_word_embeddings",
        True,
        "a separate output projection",
        "here the output projection is the shared embedding table",
    )
    _need(
        config,
        path,
        "router_dtype",
        "float32",
        "routing in lower precision",
        "routing runs in fp32 here: set router_dtype float32 in config.json to import anyway",
    )
    routing, notes = imported_routing(config, path)  # policy, normalisation order, eval capacity, batch-major
    for name, wanted in (
        ("pad_token_id", PAD),
        ("bos_token_id", BOS),
        ("eos_token_id", EOS),
        ("decoder_start_token_id", EOS),
    ):
        _need(
            config,
            path,
            name,
            wanted,
            "fairseq's dictionary has <s> 0, <pad> 1, </s> 2 and starts decoding from </s>",
            "convert the vocabulary to fairseq's dictionary order first",
        )
    activation = config.get("activation_function", "relu")
    if activation not in ACTIVATIONS_BACK:
        raise CheckpointSetError(
            f"{path}: activation_function is {activation!r}, which fairseq's --activation-fn "
            f"has no counterpart of (nothing was written)"
        )
    steps = {side: int(config.get(f"{side}_sparse_step", 4)) for side in SIDES}
    if not any(steps[side] > 0 and steps[side] <= int(config[f"{side}_layers"]) for side in SIDES):
        raise CheckpointSetError(
            f"{path} has no sparse layer (encoder/decoder_sparse_step {steps['encoder']}/"
            f"{steps['decoder']}): a dense model, which moe_transformer does not hold; use "
            f"fairseq's transformer (nothing was written)"
        )
    if config.get("expert_capacity") is not None:
        notes.append(
            f"expert_capacity {config['expert_capacity']}: NllbMoe's fixed training capacity; imported as "
            f"--moe-capacity-factor 1 (2*ceil(S/E) slots, NllbMoe's own when it is unset); training only"
        )
    if config.get("router_ignore_padding_tokens", False):
        notes.append(
            "router_ignore_padding_tokens true: pads were routed there; never here (real tokens' outputs are "
            "the same where nothing is dropped)"
        )
    eom = float(config.get("moe_token_dropout", 0.0))
    if eom:
        notes.append(
            f"moe_token_dropout {eom:g} -> --moe-eom {eom:g}: the same in evaluation; in training whole "
            f"expert outputs are masked here, element-wise dropout there"
        )
    options = argparse.Namespace(
        arch="moe_transformer",
        _name="moe_transformer",
        task="translation",
        criterion="cross_entropy",
        share_all_embeddings=True,
        share_decoder_input_output_embed=True,
        encoder_normalize_before=True,
        decoder_normalize_before=True,
        encoder_learned_pos=False,
        decoder_learned_pos=False,
        layernorm_embedding=False,
        encoder_embed_dim=int(config["d_model"]),
        decoder_embed_dim=int(config["d_model"]),
        decoder_input_dim=int(config["d_model"]),
        decoder_output_dim=int(config["d_model"]),
        max_source_positions=int(config.get("max_position_embeddings", 1024)),
        max_target_positions=int(config.get("max_position_embeddings", 1024)),
        no_scale_embedding=not config.get("scale_embedding", True),
        activation_fn=ACTIVATIONS_BACK[activation],
        dropout=float(config.get("dropout", 0.1)),
        attention_dropout=float(config.get("attention_dropout", 0.1)),
        activation_dropout=float(config.get("activation_dropout", 0.1)),
        **{name: OPTIONS[name].type(config[hf]) for name, hf in HF_NAMES.items()},  # the options carried as they are
        moe_top_k=2,
        moe_router="top",
        moe_capacity_factor=1.0,
        moe_gating_use_fp32=True,
        **routing,
        moe_freq=steps["encoder"] or steps["decoder"],
    )
    for side in SIDES:
        setattr(options, f"{side}_layers", int(config[f"{side}_layers"]))
        setattr(options, f"{side}_attention_heads", int(config[f"{side}_attention_heads"]))
        setattr(options, f"{side}_ffn_embed_dim", int(config[f"{side}_ffn_dim"]))
        setattr(options, f"{side}_moe_freq", steps[side])
        setattr(options, f"{side}_layerdrop", float(config.get(f"{side}_layerdrop", 0.0)))
    return options, notes
