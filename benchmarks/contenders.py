"""What benchmarks/moe_layer.py times: one training step (forward + backward) of each contender.

Every contender owns its modules, a fixed input and a fixed upstream gradient, and ``step()``
clears its gradients the way fairseq does (set to None) before running forward and backward, so
every step allocates its gradients afresh, as in training.

* ``moe``: our MoELayer on N tokens, dropless (capacity factor 0) unless a capacity factor is
  given (then slots over ``k * int(cf * N / E)`` per expert are dropped, Tutel's semantics).
* ``floor``: the work the MoE layer cannot avoid: one dense FFN (d -> H -> d, ReLU) applied to the
  k*N token copies in a single call. The experts do exactly these FLOPs; routing, dispatch and
  combine are the overhead on top.
* ``expert floor``: the E experts' GEMM pairs alone (forward and backward), on the rows the MoE
  contender's router sends each expert: the floor for E small experts (``ExpertGemmFloor``).
* ``dense``: a transformer FFN with the MoE layer's active parameters per token: d -> k*H -> d on
  N tokens. Same FLOPs as the floor, different GEMM shapes.
* ``fairscale``: fairscale.nn.MOELayer with Top2Gate (GShard's einsum dispatch, capacity 2N/E) and
  E experts of the same FFN, on N tokens (k=2 only: Top2Gate is top-2).
"""

import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

# fairscale is installed next to the venv, not into it: installing it into the venv changes what
# fairseq imports (and warns about) in every run.
FAIRSCALE_DIR = os.path.join(sys.prefix, "benchmark-deps")


# fmt: off
@dataclass
class Shape:
    d_model: int
    hidden: int
    experts: int
    k: int
    tokens: int
# fmt: on


class Contender:
    name = "?"

    def __init__(self, shape: Shape, device, dtype, seed: int = 0):
        self.shape, self.device, self.dtype = shape, device, dtype
        g = torch.Generator().manual_seed(seed)
        n = self.input_tokens()
        self.x = torch.randn(n, shape.d_model, generator=g).to(device, dtype).requires_grad_()
        self.upstream = torch.randn(n, shape.d_model, generator=g).to(device, dtype)
        self.module = self.build().to(device, dtype)

    def input_tokens(self) -> int:
        return self.shape.tokens

    def build(self) -> nn.Module:
        raise NotImplementedError

    def forward(self) -> torch.Tensor:
        return self.module(self.x)

    def step(self) -> None:
        self.module.zero_grad(set_to_none=True)
        self.x.grad = None
        self.forward().backward(self.upstream)


def ffn(d_model: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_model, hidden), nn.ReLU(), nn.Linear(hidden, d_model))


class Floor(Contender):
    name = "floor"

    def input_tokens(self):
        return self.shape.k * self.shape.tokens

    def build(self):
        return ffn(self.shape.d_model, self.shape.hidden)


class ExpertGemmFloor(Contender):
    """The E experts' GEMMs alone: for each expert, on its share of the k*N token copies, the two
    forward GEMMs and the four backward ones (input and weight gradients), ReLU, and its weight
    gradients written afresh, as a step does; no router, no dispatch, no combine. With one expert
    this is the floor; with many it is what E small GEMM pairs cost on this machine. Rows per
    expert are those the MoE contender's router gives the same input (``counts``), else even."""

    name = "expert floor"

    def __init__(self, shape, device, dtype, seed=0, counts=None):
        total = shape.k * shape.tokens
        even = [total // shape.experts + (i < total % shape.experts) for i in range(shape.experts)]
        self.counts = list(counts) if counts is not None else even
        super().__init__(shape, device, dtype, seed)

    def input_tokens(self):
        return self.shape.k * self.shape.tokens

    def build(self):
        s = self.shape
        module = nn.Module()
        module.w1 = nn.Parameter(torch.randn(s.experts, s.hidden, s.d_model) / s.d_model**0.5)
        module.w2 = nn.Parameter(torch.randn(s.experts, s.d_model, s.hidden) / s.hidden**0.5)
        module.b1 = nn.Parameter(torch.zeros(s.experts, s.hidden))
        module.b2 = nn.Parameter(torch.zeros(s.experts, s.d_model))
        return module

    @torch.no_grad()
    def step(self):
        # Buffers as the layer's fused experts allocate them: once per step, for all experts
        # (a fresh [rows_i, H] tensor per expert and GEMM would time the allocator, not the GEMMs).
        m, x, g = self.module, self.x, self.upstream
        grad_w1, grad_w2 = torch.empty_like(m.w1), torch.empty_like(m.w2)
        grad_b1, grad_b2 = torch.empty_like(m.b1), torch.empty_like(m.b2)
        grad_x = torch.empty_like(x)
        hidden = x.new_empty(x.shape[0], m.w1.shape[1])
        out = torch.empty_like(x)
        grad_hidden = x.new_empty(max(self.counts), m.w1.shape[1])
        ones = x.new_ones(max(self.counts))
        start = 0
        for i, rows in enumerate(self.counts):
            end = start + rows
            xi, gi, h, grad_h = x[start:end], g[start:end], hidden[start:end], grad_hidden[:rows]
            torch.relu_(torch.addmm(m.b1[i], xi, m.w1[i].t(), out=h))
            torch.addmm(m.b2[i], h, m.w2[i].t(), out=out[start:end])
            torch.mm(gi.t(), h, out=grad_w2[i])
            torch.mv(gi.t(), ones[:rows], out=grad_b2[i])
            torch.mm(gi, m.w2[i], out=grad_h)
            torch.ops.aten.threshold_backward.grad_input(grad_h, h, 0, grad_input=grad_h)
            torch.mm(grad_h.t(), xi, out=grad_w1[i])
            torch.mv(grad_h.t(), ones[:rows], out=grad_b1[i])
            torch.mm(grad_h, m.w1[i], out=grad_x[start:end])
            start = end
        m.w1.grad, m.w2.grad, m.b1.grad, m.b2.grad, x.grad = grad_w1, grad_w2, grad_b1, grad_b2, grad_x


class DenseSameActiveParams(Contender):
    name = "dense"

    def build(self):
        return ffn(self.shape.d_model, self.shape.k * self.shape.hidden)


class OurMoE(Contender):
    name = "moe"

    def __init__(self, shape, device, dtype, seed=0, expert_matmul="auto", skew=None, capacity_factor=0.0):
        self.expert_matmul, self.skew, self.capacity_factor = expert_matmul, skew, capacity_factor
        if expert_matmul != "auto":
            self.name = f"moe[{expert_matmul}]"
        if capacity_factor:
            self.name = f"{self.name} cf={capacity_factor:g}"
        if skew:
            self.name = f"{self.name} skewed x{skew:g}"
        super().__init__(shape, device, dtype, seed)
        if skew:
            self.make_skewed(skew)

    def build(self):
        from fairseq_moe_ext.moe import MoELayer, MoELayerConfig

        s = self.shape
        layer = MoELayer(MoELayerConfig.of(s.d_model, s.hidden, s.experts, k=s.k, capacity_factor=self.capacity_factor))
        layer.experts.matmul = self.expert_matmul
        return layer

    @torch.no_grad()
    def make_skewed(self, factor: float) -> None:
        """Expert 0 becomes the first choice of enough tokens to take ``factor`` times its fair
        share (N*k/E slots): those tokens get a feature that only expert 0's router row reads."""
        s = self.shape
        fair_share = s.tokens * s.k / s.experts
        chosen = min(s.tokens, round(factor * fair_share))
        self.x[:, 0] = 0.0
        self.x[:chosen, 0] = 1.0
        weight = self.module.router.wg.weight
        weight[:, 0] = 0.0
        weight[0, 0] = 30.0

    def routing_stats(self):
        with torch.no_grad():
            _, aux = self.module.forward_with_aux(self.x)
        return aux.stats

    def expert_rows(self):
        """Rows each expert gets from the routing of this input, as routed now."""
        return [int(c) for c in self.routing_stats()["expert_slots"].tolist()]

    def busiest_expert_share(self) -> float:
        """Load of the busiest expert over its fair share, as routed now."""
        load = self.routing_stats()["expert_slots"]
        return float(load.max() / (load.sum() / len(load)))

    def dropped_fraction(self) -> float:
        """Share of the k*N slots dropped for being over capacity, as routed now."""
        return float(self.routing_stats()["dropped_slots"]) / (self.shape.k * self.shape.tokens)

    def forward(self):
        return self.module(self.x)


class FairscaleMoE(Contender):
    name = "fairscale"

    def input_tokens(self):
        return self.shape.tokens

    def build(self):
        from fairscale.nn import MOELayer, Top2Gate

        s = self.shape
        ensure_single_process_group(self.device)
        experts = nn.ModuleList([ffn(s.d_model, s.hidden) for _ in range(s.experts)])
        return MOELayer(Top2Gate(s.d_model, s.experts), experts)

    def forward(self):
        s = self.shape
        # MOELayer wants [s, t, d_model] with s divisible by E; its gate sees all s*t tokens at
        # once, so capacity is 2N/E whatever the split.
        x = self.x.view(s.experts, s.tokens // s.experts, s.d_model)
        return self.module(x).view(s.tokens, s.d_model)


def import_fairscale():
    """fairscale's MOELayer and Top2Gate, or the reason they cannot be used."""
    if FAIRSCALE_DIR not in sys.path and os.path.isdir(FAIRSCALE_DIR):
        sys.path.append(FAIRSCALE_DIR)
    try:
        from fairscale.nn import MOELayer, Top2Gate  # noqa: F401
    except Exception as e:  # ImportError, or fairscale failing against this torch
        return f"{type(e).__name__}: {e}"
    return None


def ensure_single_process_group(device) -> None:
    """MOELayer calls all_to_all on its group even alone; give it a group of one process."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def fits_fairscale(shape: Shape):
    """Why fairscale cannot run these shapes, or None."""
    if shape.k != 2:
        return f"Top2Gate is top-2 only, k={shape.k}"
    if shape.tokens % shape.experts:
        return f"Top2Gate needs tokens ({shape.tokens}) divisible by experts ({shape.experts})"
    return None


def build_contender(name: str, shape: Shape, device, dtype, **kw) -> Contender:
    kinds = {
        "floor": Floor,
        "expert floor": ExpertGemmFloor,
        "dense": DenseSameActiveParams,
        "moe": OurMoE,
        "fairscale": FairscaleMoE,
    }
    return kinds[name](shape, device, dtype, **kw)
