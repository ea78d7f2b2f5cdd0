"""Parameter names between this project's ``moe_transformer`` and Hugging Face's NllbMoe.

Per layer (``<side>.layers.<i>.`` here, ``model.<side>.layers.<i>.`` there) the names are fairseq's and
transformers' own: attention and layer norms keep their names except the decoder's cross attention
(``encoder_attn`` -> ``cross_attention``) and the norm before the feed-forward block
(``final_layer_norm`` -> ``ff_layer_norm``). A dense block's ``fc1``/``fc2`` become ``ffn.fc1``/``ffn.fc2``.
An MoE block's router ``fc1.router.wg.weight`` [E, d] is ``ffn.router.classifier.weight``, and its stacked
experts ``fc1.experts.batched_fc1_w`` [E, hidden, d] (``_fc1_b``, ``_fc2_w`` [E, d, hidden], ``_fc2_b``)
are one tensor per expert there, ``ffn.experts.expert_<j>.fc1.weight`` [hidden, d] etc., j the global id.

The one embedding table (``--share-all-embeddings``: encoder and decoder input and the decoder's
output projection) is ``model.shared.weight``; transformers ties ``model.encoder.embed_tokens``,
``model.decoder.embed_tokens`` and ``lm_head`` to it.

Reading, the ``model.`` prefix is optional: ``NllbMoeForConditionalGeneration`` saves every name with it (and
may save ``lm_head.weight``), the base ``NllbMoeModel`` without it and with no ``lm_head``. The hub's
``facebook/nllb-moe-54b`` is the latter (transformers' converter saves an ``NllbMoeModel``): ``shared.weight``,
``encoder.layers.3.ffn.experts.expert_0.fc1.weight``, ...
"""

import re
from typing import Dict, Optional, Tuple

EMBEDDING = "encoder.embed_tokens.weight"
TIED_HERE = ("decoder.embed_tokens.weight", "decoder.output_projection.weight")
HF_EMBEDDING = "model.shared.weight"
HF_EMBEDDINGS = (HF_EMBEDDING, "shared.weight")  # NllbMoeForConditionalGeneration's, NllbMoeModel's
# fmt: off
HF_TIED = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "encoder.embed_tokens.weight",
           "decoder.embed_tokens.weight", "lm_head.weight")
# fmt: on
# Buffers fairseq keeps in a state dict that carry no weights (rebuilt when a model is built).
NOT_WEIGHTS = re.compile(r"^(encoder|decoder)\.(version|embed_positions\._float_tensor)$")
VERSION = 3.0  # what fairseq's TransformerEncoder/Decoder register as their ``version`` buffer

_WB = ("weight", "bias")
_LAYER: Dict[str, str] = {}
for _wb in _WB:
    for _proj in ("q", "k", "v", "out"):
        _LAYER[f"self_attn.{_proj}_proj.{_wb}"] = f"self_attn.{_proj}_proj.{_wb}"
        _LAYER[f"encoder_attn.{_proj}_proj.{_wb}"] = f"cross_attention.{_proj}_proj.{_wb}"
    _LAYER[f"self_attn_layer_norm.{_wb}"] = f"self_attn_layer_norm.{_wb}"
    _LAYER[f"encoder_attn_layer_norm.{_wb}"] = f"cross_attention_layer_norm.{_wb}"
    _LAYER[f"final_layer_norm.{_wb}"] = f"ff_layer_norm.{_wb}"
    _LAYER[f"fc1.{_wb}"] = f"ffn.fc1.{_wb}"
    _LAYER[f"fc2.{_wb}"] = f"ffn.fc2.{_wb}"
_LAYER["fc1.router.wg.weight"] = "ffn.router.classifier.weight"
_LAYER_BACK = {hf: ours for ours, hf in _LAYER.items()}
# fmt: off
EXPERT_TENSORS = {"batched_fc1_w": "fc1.weight", "batched_fc1_b": "fc1.bias", "batched_fc2_w": "fc2.weight",
                  "batched_fc2_b": "fc2.bias"}
# fmt: on
_EXPERT_BACK = {hf: ours for ours, hf in EXPERT_TENSORS.items()}

_OURS = re.compile(r"^(?P<side>encoder|decoder)\.(?:layers\.(?P<i>\d+)\.(?P<rest>.+)|layer_norm\.(?P<wb>weight|bias))$")
_OUR_EXPERT = re.compile(r"^(?P<layer>(?:encoder|decoder)\.layers\.\d+)\.fc1\.experts\.(?P<name>batched_fc[12]_[wb])$")
_HF = re.compile(
    r"^(?:model\.)?(?P<side>encoder|decoder)\."
    r"(?:layers\.(?P<i>\d+)\.(?P<rest>.+)|layer_norm\.(?P<wb>weight|bias))$"
)
_HF_EXPERT = re.compile(
    r"^(?:model\.)?(?P<layer>(?:encoder|decoder)\.layers\.\d+)\.ffn\.experts\.expert_(?P<j>\d+)\."
    r"(?P<name>fc[12]\.(?:weight|bias))$"
)


def expert_tensor(key: str) -> Optional[Tuple[str, str]]:
    """(layer, stacked tensor name) for one of our stacked expert tensors, else None."""
    match = _OUR_EXPERT.match(key)
    return (match["layer"], match["name"]) if match else None


def hf_expert_key(layer: str, name: str, expert: int) -> str:
    return f"model.{layer}.ffn.experts.expert_{expert}.{EXPERT_TENSORS[name]}"


def hf_key(key: str) -> Optional[str]:
    """The NllbMoe name of one of our (non-expert) parameters; None if it has none."""
    if key == EMBEDDING:
        return HF_EMBEDDING
    match = _OURS.match(key)
    if not match:
        return None
    if match["wb"]:
        return f"model.{match['side']}.layer_norm.{match['wb']}"
    rest = _LAYER.get(match["rest"])
    return None if rest is None else f"model.{match['side']}.layers.{match['i']}.{rest}"


def our_key(key: str) -> Optional[str]:
    """Ours for a non-expert NllbMoe name, ``model.`` prefixed or not; None if none (experts: ``hf_expert``)."""
    if key in HF_EMBEDDINGS:
        return EMBEDDING
    match = _HF.match(key)
    if not match:
        return None
    if match["wb"]:
        return f"{match['side']}.layer_norm.{match['wb']}"
    rest = _LAYER_BACK.get(match["rest"])
    return None if rest is None else f"{match['side']}.layers.{match['i']}.{rest}"


def hf_expert(key: str) -> Optional[Tuple[str, str, int]]:
    """(our layer, our stacked tensor name, global expert id) for an NllbMoe expert tensor (``model.`` prefixed or
    not), else None."""
    match = _HF_EXPERT.match(key)
    if not match:
        return None
    return match["layer"], _EXPERT_BACK[match["name"]], int(match["j"])
