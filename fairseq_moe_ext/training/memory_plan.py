"""What one worker holds during training, by backend, expert-parallel size and precision: the arithmetic
behind ``fairseq-moe plan`` (``plan_model.py`` builds the model, ``plan_cli.py`` prints it).

The inputs are the shapes of the model's parameters (shared ones once each, expert ones with every
expert: dim 0 is E), the precision and the optimizer as fairseq-train's flags give them. What each
worker holds, in bytes:

* parameters: ``legacy_ddp`` every shared tensor whole and E/P experts, in the model's dtype (fp32, or
  fp16/bf16 under ``--fp16``/``--bf16``/``--memory-efficient-*``; fp32 under ``--amp``).
  ``fully_sharded``: torch's dim-0 chunk of each shared tensor over the W workers (``torch.chunk``:
  ceil(rows / W) rows, the last ranks fewer), kept in fp32 at rest whatever the precision (FSDP2's
  MixedPrecisionPolicy casts a gathered copy for forward and backward); experts E/P whole, or, sharded
  over their replica group (W/P workers), the dim-0 chunk of the E/P local experts.
* gradients: the parameters' shapes in the parameters' dtype (``fully_sharded``: fp32 slices, reduced
  in fp32).
* master copies: fairseq's ``FP16Optimizer`` (plain ``--fp16``/``--bf16`` under ``legacy_ddp``) keeps
  an fp32 copy of every parameter *and* an fp32 gradient for it (8 bytes per element); the
  memory-efficient variants and ``--amp`` keep none, nor does ``fully_sharded`` (its fp32 shards are
  the master copy).
* optimizer state: fp32, per element of what the optimizer steps (``OPTIMIZER_STATE``); Adafactor's
  factored moments are a row and a column per matrix (a flat fp32 buffer, as plain ``--fp16`` on one
  worker builds, is one vector: not factored).
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..moe.expert_layout import valid_parallel_sizes
from ..options.ranges import LARGEST_DEVICE
from ..parallel.plan import ParallelPlan

Shape = Tuple[int, ...]
FP32 = 4


@dataclass(frozen=True)
class ModelShapes:
    shared: Tuple[Shape, ...]  # each shared parameter once
    experts: Tuple[Shape, ...]  # each expert parameter with all E experts of its layer (dim 0 = E)
    side_experts: Tuple[Tuple[str, int], ...]  # each side's E per MoE layer: (("encoder", 4), ("decoder", 2))

    @property
    def expert_counts(self) -> Tuple[int, ...]:
        """The MoE layers' E, each once (two where the sides differ)."""
        return tuple(sorted({e for _, e in self.side_experts}))


@dataclass(frozen=True)
class Precision:
    name: str  # fp32, fp16, bf16, memory_efficient_fp16, memory_efficient_bf16, amp
    param_bytes: int  # the model's dtype under legacy_ddp
    master: bool  # FP16Optimizer: an fp32 copy and fp32 gradient of every parameter
    flag: str  # how the user asked for it


def precision_of(values: Callable[[str], object]) -> Precision:
    """``values(name)``: the value of a fairseq common option (fp16, bf16, memory_efficient_fp16, ...)."""
    if values("memory_efficient_bf16"):
        return Precision("memory_efficient_bf16", 2, False, "--memory-efficient-bf16")
    if values("memory_efficient_fp16"):
        return Precision("memory_efficient_fp16", 2, False, "--memory-efficient-fp16")
    if values("amp"):
        return Precision("amp", FP32, False, "--amp")
    if values("bf16"):
        return Precision("bf16", 2, True, "--bf16")
    if values("fp16"):
        return Precision("fp16", 2, True, "--fp16")
    return Precision("fp32", FP32, False, "(fp32)")


def _adafactor(shape: Shape, options: Dict) -> int:
    """fairseq's Adafactor: a row and a column of second moments for every tensor of 2 or more dims
    (factored, its default), a whole one otherwise; a first moment when --beta1 is given."""
    numel = math.prod(shape)
    if len(shape) >= 2 and not options.get("adafactor_unfactored"):
        second = math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
    else:
        second = numel
    return second + (numel if options.get("beta1") is not None else 0)


# Elements of fp32 optimizer state per parameter of ``shape`` (fairseq 0.12.3's optimizers; 0-dim
# entries such as Adam's step are not counted).
OPTIMIZER_STATE: Dict[str, Callable[[Shape, Dict], int]] = {
    "adam": lambda s, o: math.prod(s) * (3 if o.get("amsgrad") else 2),
    "adamax": lambda s, o: 2 * math.prod(s),
    "adadelta": lambda s, o: 2 * math.prod(s),
    "adagrad": lambda s, o: math.prod(s),
    "nag": lambda s, o: math.prod(s),
    "sgd": lambda s, o: math.prod(s) if o.get("momentum") else 0,
    "adafactor": _adafactor,
}


# A layout plan prints a row for: the model's ParallelPlan (W, P, the backend, experts whole or sharded).
Layout = ParallelPlan


def layouts(world_size: int, *expert_counts: int) -> List[Layout]:
    """Every layout of ``world_size`` workers: each valid P under legacy_ddp, under fully_sharded, and under
    fully_sharded with experts sharded over their replicas where there are replicas (W > P); a model without
    experts gets legacy_ddp and fully_sharded (P = 1)."""
    if not expert_counts:  # a dense model (a distilled student): no experts to place
        return [ParallelPlan(world_size, 1, backend="legacy_ddp"), ParallelPlan(world_size, 1, backend="fully_sharded")]
    rows = []
    for p in valid_parallel_sizes(world_size, *expert_counts):
        rows.append(ParallelPlan(world_size, p, backend="legacy_ddp"))
        rows.append(ParallelPlan(world_size, p, backend="fully_sharded"))
        if world_size > p:
            rows.append(ParallelPlan(world_size, p, backend="fully_sharded", experts="sharded"))
    return rows


def chunk_rows(rows: int, parts: int, index: int) -> int:
    """Rows of part ``index`` when ``rows`` are cut with torch.chunk into ``parts`` (FSDP2's split)."""
    size = -(-rows // parts)
    return max(0, min(size, rows - index * size))


def _sliced(shape: Shape, parts: int, index: int) -> Shape:
    return (chunk_rows(shape[0], parts, index), *shape[1:]) if shape else shape


def held_shapes(model: ModelShapes, layout: Layout, rank: int = 0) -> Dict[str, List[Shape]]:
    """The shapes of the parameters worker ``rank`` holds: shared and expert."""
    w, p = layout.world_size, layout.parallel_size
    shared = list(model.shared)
    if layout.backend == "fully_sharded":
        shared = [_sliced(s, w, rank) for s in shared]
    local = [(s[0] // p, *s[1:]) for s in model.experts]  # E/P experts
    if layout.experts_sharded:
        local = [_sliced(s, w // p, rank // p) for s in local]
    return {"shared": shared, "expert": local}


@dataclass(frozen=True)
class Held:
    """Bytes one worker holds for one kind of parameter (shared or expert)."""

    params: int
    grads: int
    master: int  # fp32 parameter copies and their fp32 gradients (FP16Optimizer)
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer


def held_bytes(
    shapes: Sequence[Shape],
    layout: Layout,
    precision: Precision,
    optimizer: str,
    options: Dict,
    flat_master: bool = False,
) -> Held:
    """``flat_master``: FP16Optimizer flattens every parameter into one fp32 vector (plain --fp16 on
    one worker, see fairseq_integration/precision.py hook 12): its optimizer state is that vector's."""
    numel = sum(math.prod(s) for s in shapes)
    if layout.backend == "fully_sharded" and precision.name != "fp32":
        param_bytes, master = FP32, False  # fp32 shards at rest, low precision only while gathered
    else:
        param_bytes, master = precision.param_bytes, precision.master
    state = OPTIMIZER_STATE[optimizer]
    stepped = [(numel,)] if master and flat_master and numel else list(shapes)
    return Held(
        params=numel * param_bytes,
        grads=numel * param_bytes,
        master=2 * FP32 * numel if master else 0,
        optimizer=FP32 * sum(state(s, options) for s in stepped if math.prod(s)),
    )


def gathered_unit_bytes(unit_numels: Sequence[int], layout: Layout, precision: Precision) -> int:
    """fully_sharded: the most bytes of gathered (whole) parameters alive at once: the root (embeddings,
    output projection) and one layer, each in the compute dtype (forward and backward gather the same
    units, freed after each; prefetching may add the next layer, counted)."""
    if layout.backend != "fully_sharded" or not unit_numels:
        return 0
    dtype = FP32 if precision.name in ("fp32", "amp") else 2
    root, layers = unit_numels[0], sorted(unit_numels[1:], reverse=True)
    return dtype * (root + sum(layers[:2]))


def gathered_expert_bytes(layer_numel: int, layout: Layout, precision: Precision) -> int:
    """Experts sharded over their replica group: one MoE layer's E/P experts gathered whole (and the
    next one prefetched) in the compute dtype; ``layer_numel``: one MoE layer's parameters, all E experts."""
    if not layout.experts_sharded:
        return 0
    dtype = FP32 if precision.name in ("fp32", "amp") else 2
    return 2 * dtype * (layer_numel // layout.parallel_size)


def parse_size(text: str) -> int:
    """'80GiB', '80GB', '141G', '512MiB', '1073741824' -> bytes (GB = 10**9, GiB = 2**30)."""
    units = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    units.update({"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12})
    units.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
    value = text.strip().upper()
    number = value.rstrip("KMGTIB")
    unit = value[len(number) :]
    try:
        amount = float(number)
    except ValueError:
        amount = None
    if amount is None or unit not in units or not 0 < amount < math.inf:
        raise ValueError(
            f"--device-memory {text!r} is not a size: give a number with a unit, e.g. 80GiB, 80GB or 141GB"
        )
    if amount * units[unit] > LARGEST_DEVICE:
        raise ValueError(
            f"--device-memory {text!r} is beyond 4 x the largest accelerator's memory (288 GB) (at most 1 TiB): "
            f"give one device's memory, e.g. 80GB"
        )
    return int(amount * units[unit])


def gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"
