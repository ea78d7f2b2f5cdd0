"""A deliberately naive MoE: one token and one choice at a time, written from the definitions.

Tests compare the real layer against it; nothing here is shared with the implementation except
the parameters it reads. It lives in the package, beside what it checks, so that the tests
(tests/core) and the GPU one-shot (benchmarks/device/oneshot_layer.py, which imports nothing from
tests/) share one oracle; no module of the package imports it
(tests/repo/test_package_tiers.py).
"""

import math

import torch
import torch.nn.functional as F


def reference_capacity(n, num_experts, k, cf):
    if cf == 0:
        return None
    return k * int(abs(cf) * math.ceil(n / num_experts))


def reference_moe(layer, x, padding_mask=None, activation=F.relu, training=None, choices_out=None):
    """Recompute ``layer``'s output from its parameters, token by token. Returns (y, kept); each real
    token's chosen experts are appended to ``choices_out`` when given."""
    training = layer.training if training is None else training
    router, experts = layer.router, layer.experts
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    mask = torch.zeros(flat.shape[0], dtype=torch.bool) if padding_mask is None else padding_mask.reshape(-1)
    real = [t for t in range(flat.shape[0]) if not mask[t]]
    n, num_experts, k = len(real), layer.num_experts, layer.k

    sigmoid = router.router_type == "sigmoid"
    bias = None if layer.balance_bias is None else layer.balance_bias.bias  # the layer's own (layer.py)
    probs, choices, top1 = {}, {}, {}
    for t in real:
        logits = reference_logits(router, flat[t])
        # Softmax, or DeepSeek-V3's independent sigmoid per expert.
        p = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
        # Loss-free balancing chooses by score + bias; without a bias, by logit.
        choose_by = logits if bias is None else p + bias
        order = sorted(range(num_experts), key=lambda e: (-float(choose_by[e].detach()), e))[:k]
        g = torch.stack([p[e] for e in order])  # the gates never see the bias
        if router.normalize_gates or sigmoid:
            # k = 1: the gate's value is 1, its gradient that of log p (the router's straight-through).
            g = g / (g.sum().detach() if k == 1 else g.sum())
        probs[t], choices[t] = g, order
        # Batch-prioritised routing ranks by the top-1 probability over all experts, before any renormalisation
        # over the chosen k (the nllb branch's and HF NllbMoe's importance score).
        top1[t] = float((p / p.sum())[order[0]].detach())

    if choices_out is not None:
        choices_out.extend(choices[t] for t in real)
    cf = layer.capacity_factor if training else layer.eval_capacity_factor
    capacity = reference_capacity(n, num_experts, k, cf)
    service = list(real)
    if router.batch_prioritized:
        service = sorted(real, key=lambda t: (-top1[t], real.index(t)))
    kept, load = set(), [0] * num_experts
    for j in range(k):
        for t in service:
            e = choices[t][j]
            if capacity is None or load[e] < capacity:
                kept.add((t, j))
            load[e] += 1

    out = []
    for t in range(flat.shape[0]):
        y = reference_shared_experts(layer, flat[t], activation)
        if not mask[t]:
            for j in range(k):
                if (t, j) in kept:
                    e = choices[t][j]
                    h = activation(F.linear(flat[t], experts.batched_fc1_w[e], experts.batched_fc1_b[e]))
                    y = y + probs[t][j].to(flat.dtype) * F.linear(h, experts.batched_fc2_w[e], experts.batched_fc2_b[e])
        out.append(y)
    return torch.stack(out).view(shape), kept


def reference_logits(router, token):
    """One token's router logits in fp32: a linear projection, or (cosine) the scaled cosine of the
    projected token against each expert's vector, the scale exp(temperature) capped at 100."""
    if router.router_type != "cosine":
        return F.linear(token.float(), router.wg.weight.float())
    proj = router.cosine_projector
    h = F.linear(token.float(), proj.weight.float(), proj.bias.float())
    sim = router.sim_matrix.float()
    scale = torch.clamp(router.temperature.float(), max=math.log(100.0)).exp()
    return torch.stack([h @ sim[:, e] / (h.norm() * sim[:, e].norm()) for e in range(sim.shape[1])]) * scale


def reference_shared_experts(layer, token, activation=F.relu):
    """The sum of the layer's S shared experts on one token (pad tokens included), each expert a
    block of the stored width-S*h FFN: rows of fc1, columns of fc2; fc2's bias once for all."""
    shared = layer.shared_experts
    if shared is None:
        return torch.zeros(token.shape[-1], dtype=token.dtype)
    ffn, h = shared.ffn, shared.hidden_dim
    y = ffn.batched_fc2_b[0].clone()
    for s in range(shared.count):
        block = slice(s * h, (s + 1) * h)
        hidden = activation(F.linear(token, ffn.batched_fc1_w[0, block], ffn.batched_fc1_b[0, block]))
        y = y + F.linear(hidden, ffn.batched_fc2_w[0][:, block])
    return y


def reference_bias_update(bias, choices, num_experts, rate):
    """DeepSeek-V3's rule from per-token choice lists (every micro-batch, every worker):
    b_i + rate * sign(mean load - load_i)."""
    load = [0] * num_experts
    for order in choices:
        for e in order:
            load[e] += 1
    mean = sum(load) / num_experts
    return torch.tensor([float(b) + rate * ((mean > n) - (mean < n)) for b, n in zip(bias.tolist(), load)])


def assert_layer_matches_reference(layer, x, mask, upstream):
    """The layer's output and every gradient (parameters and input, through ``(y * upstream).sum()``)
    equal the reference's; returns the layer's (y, aux) and the reference's kept slots."""

    def grads():
        named = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        named["input"] = x.grad.clone()
        return named

    y, aux = layer.forward_with_aux(x, mask)
    (y * upstream).sum().backward()
    got = grads()
    layer.zero_grad()
    x.grad = None
    y_ref, kept = reference_moe(layer, x, mask)
    (y_ref * upstream).sum().backward()
    want = grads()

    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    return y, aux, kept
