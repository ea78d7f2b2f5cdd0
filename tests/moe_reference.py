"""A deliberately naive MoE: one token and one choice at a time, written from the definitions.

Tests compare the real layer against it; nothing here is shared with the implementation except
the parameters it reads.
"""

import math

import torch
import torch.nn.functional as F


def reference_capacity(n, num_experts, k, cf):
    if cf == 0:
        return None
    return k * int(abs(cf) * math.ceil(n / num_experts))


def reference_moe(layer, x, padding_mask=None, activation=F.relu, training=None):
    """Recompute ``layer``'s output from its parameters, token by token. Returns (y, kept)."""
    training = layer.training if training is None else training
    router, experts = layer.router, layer.experts
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    mask = torch.zeros(flat.shape[0], dtype=torch.bool) if padding_mask is None else padding_mask.reshape(-1)
    real = [t for t in range(flat.shape[0]) if not mask[t]]
    n, num_experts, k = len(real), layer.num_experts, layer.k

    probs, choices = {}, {}
    for t in real:
        logits = F.linear(flat[t].float(), router.wg.weight.float())
        p = torch.softmax(logits, dim=-1)
        order = sorted(range(num_experts), key=lambda e: (-float(logits[e].detach()), e))[:k]
        g = torch.stack([p[e] for e in order])
        if router.normalize_gates:
            g = g / g.sum()
        probs[t], choices[t] = g, order

    cf = layer.capacity_factor if training else layer.eval_capacity_factor
    capacity = reference_capacity(n, num_experts, k, cf)
    service = list(real)
    if router.batch_prioritized:
        service = sorted(real, key=lambda t: (-float(probs[t][0].detach()), real.index(t)))
    kept, load = set(), [0] * num_experts
    for j in range(k):
        for t in service:
            e = choices[t][j]
            if capacity is None or load[e] < capacity:
                kept.add((t, j))
            load[e] += 1

    out = []
    for t in range(flat.shape[0]):
        y = torch.zeros(shape[-1], dtype=flat.dtype)
        if not mask[t]:
            for j in range(k):
                if (t, j) in kept:
                    e = choices[t][j]
                    h = activation(F.linear(flat[t], experts.batched_fc1_w[e], experts.batched_fc1_b[e]))
                    y = y + probs[t][j].to(flat.dtype) * F.linear(h, experts.batched_fc2_w[e], experts.batched_fc2_b[e])
        out.append(y)
    return torch.stack(out).view(shape), kept
