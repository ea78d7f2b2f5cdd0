"""What a model costs per token, from its checkpoint's state dict: parameters and forward FLOPs.

A token's *active* parameters count k of the E experts of each MoE layer (its router sends it to
k). Its forward FLOPs are 2 (a multiply and an add) per element of every weight matrix it is
multiplied by: attention projections, FFNs or its k experts, routers, the decoder's output
projection. Not counted: embedding lookups (no arithmetic), biases and layer norms (a few FLOPs per
element of the activation, not of the weight), and the attention-score products, which grow with
sentence length and are the same for models of the same width and depth. Encoder FLOPs are per
source token, decoder FLOPs per target token (the decoder's cross-attention key and value
projections really run once per source token; they are counted with the decoder, the same way for
every model). Capacity drops, which skip experts for some tokens in training, are ignored: this is
the cost of the dropless inference path.
"""

# Lookup tables, not matrices a token is multiplied by.
EMBEDDING_KEYS = ("embed_tokens.weight", "embed_positions.weight")


def _is_matrix(key: str, shape: tuple, is_expert: bool) -> bool:
    # Expert tensors are stacked along dim 0 (one slice per expert): a slice is a matrix when 2-D.
    # Shared experts are stored the same way, as one slice every token uses.
    matrix_shape = shape[1:] if is_expert or ".shared_experts." in key else shape
    return len(matrix_shape) == 2 and not key.endswith(EMBEDDING_KEYS)


def model_cost(tensors: dict, expert_keys: set, experts, k) -> dict:
    """Parameters (total, active per token) and forward FLOPs per token of encoder and decoder.

    ``tensors`` maps state-dict keys to tensors; ``expert_keys`` names the stacked expert tensors
    (each with E slices along dim 0); ``experts``/``k`` are E and top-k (None for a dense model).
    """
    if expert_keys and not (experts and k):
        raise ValueError(
            f"{len(expert_keys)} expert tensors but experts={experts!r}, k={k!r}: "
            "the checkpoint's model config must name --moe-expert-count and --moe-top-k"
        )
    total = active = 0
    flops = {"encoder": 0, "decoder": 0}
    for key, tensor in tensors.items():
        is_expert = key in expert_keys
        # Integer arithmetic: E divides each stacked tensor's element count.
        used = tensor.numel() * k // experts if is_expert else tensor.numel()
        total += tensor.numel()
        active += used
        side = key.split(".", 1)[0]
        if side in flops and _is_matrix(key, tuple(tensor.shape), is_expert):
            flops[side] += 2 * used
    return {"total": total, "active": active, "encoder_flops": flops["encoder"], "decoder_flops": flops["decoder"]}
