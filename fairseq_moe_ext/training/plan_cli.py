"""``fairseq-moe plan <fairseq-train arguments> --world-size W [--device-memory 80GiB]``:
what one worker holds, per backend and expert-parallel size, before any GPU is rented.

The model is built from the same arguments as fairseq-train builds it, on the ``meta`` device (shapes
only: no memory, no weights; ``plan_model.py``); ``--dictionary-size N`` builds it with N-entry dictionaries
held in memory when the data directory is not there yet (nothing is written: a model's shapes need a
dictionary's length, not its words). The bytes come from ``memory_plan.py``, the activation bound from
``activation_bound.py``.
A bad argument is one line, as everywhere in the plugin: fairseq-train's own refusal of an argument
included (argparse's line, which fairseq's parser prints, is caught and said as plan's).
"""

import argparse
import logging
import math
import sys
import warnings
from typing import Dict, List

from ..options.ranges import PLAN_TOOL_RANGES, check_options
from . import memory_plan as mp
from .plan_model import PlanError, build_on_meta, build_task_and_model

PLAN_FLAGS = ("--world-size", "--device-memory", "--dictionary-size")
# Options plan decides itself (every backend, every P, the world size given): removed from the arguments
# the model is built with, so that fairseq-train's own checks of them do not refuse a layout plan prints.
DECIDED_HERE = (
    "--ddp-backend",
    "--moe-expert-parallel-size",
    "--distributed-world-size",
    "--moe-fully-sharded-experts",
)


def add_plan_parser(p) -> None:
    """plan's own flags, on the parser that picks them out of fairseq-train's arguments (and answers --help)."""
    p.usage = "%(prog)s <fairseq-train arguments> --world-size W [--device-memory SIZE[,...]] [--dictionary-size N]"
    p.epilog = (
        "Every other argument is fairseq-train's (the data directory, --arch, --task, ...): the model is built from "
        f"them on the meta device. plan shows every choice of {', '.join(DECIDED_HERE)}, so it sets those aside."
    )
    p.add_argument("--world-size", type=int, metavar="W", help="the number of GPUs (workers) to plan for")
    p.add_argument(
        "--device-memory",
        default=None,
        metavar="SIZE[,...]",
        help="one worker's memory, e.g. 80GiB or 80GiB,141GB: a column says whether each layout fits each size",
    )
    p.add_argument(
        "--dictionary-size",
        type=int,
        default=None,
        metavar="N",
        help="build the model with N-entry dictionaries, before the data directory exists",
    )


def split_argv(argv: List[str], prog: str = "python -m fairseq_moe_ext plan"):
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    add_plan_parser(parser)
    own, rest = parser.parse_known_args(argv)
    if own.world_size is None:
        raise PlanError("plan needs --world-size W, the number of GPUs (workers) to plan for, e.g. --world-size 8")
    check_options(PLAN_TOOL_RANGES, lambda name: getattr(own, name))
    memory = [] if own.device_memory is None else [mp.parse_size(m) for m in own.device_memory.split(",") if m]
    asked, kept, skip = {}, [], False
    for i, arg in enumerate(rest):
        if skip:
            skip = False
            continue
        name, eq, value = arg.partition("=")
        if name in DECIDED_HERE:
            if not eq and i + 1 >= len(rest):
                raise PlanError(f"{name} needs a value")
            asked[name] = value if eq else rest[i + 1]
            skip = not eq
            continue
        kept.append(arg)
    return own, memory, asked, kept


def model_shapes(model, dense: bool = False) -> mp.ModelShapes:
    """The model's parameter shapes; ``dense``: a model without MoE layers is planned too (a distilled student)."""
    from ..moe.experts import is_expert
    from ..moe.layer import MoELayer

    shared, experts = [], []
    for p in model.parameters():  # each tensor once (a shared embedding is listed once)
        (experts if is_expert(p) else shared).append(tuple(p.shape))
    sides = {}
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            sides.setdefault(name.split(".")[0], module.num_experts)
    if not sides and not dense:
        raise PlanError("the model has no MoE layers: plan is for MoE models (check --moe-freq and the expert counts)")
    return mp.ModelShapes(tuple(shared), tuple(experts), tuple(sides.items()))


def experts_per_layer(shapes: mp.ModelShapes) -> str:
    """'in 4 experts per MoE layer', or where the sides differ (--encoder/--decoder-moe-expert-count) each
    side's: 'in experts: 4 per encoder MoE layer, 2 per decoder MoE layer'."""
    if not shapes.expert_counts:
        return "in experts: none, a dense model"
    if len(shapes.expert_counts) == 1:
        return f"in {shapes.expert_counts[0]} experts per MoE layer"
    return "in experts: " + ", ".join(f"{e} per {side} MoE layer" for side, e in shapes.side_experts)


def unit_numels(model):
    """fully_sharded's units: the root's shared numel first, then each layer's (fully_sharded.wrap_units);
    and the largest MoE layer's expert numel."""
    from ..moe.experts import is_expert
    from ..moe.layer import MoELayer
    from ..parallel.fully_sharded import wrap_units

    units = wrap_units(model)
    in_units = {id(p) for u in units for p in u.parameters()}
    root = sum(p.numel() for p in model.parameters() if not is_expert(p) and id(p) not in in_units)
    units = [root, *(sum(p.numel() for p in u.parameters() if not is_expert(p)) for u in units)]
    experts = [sum(p.numel() for p in m.experts.parameters()) for m in model.modules() if isinstance(m, MoELayer)]
    return units, max(experts, default=0)


def optimizer_of(cfg) -> (str, Dict):
    name = str(cfg.optimizer._name if hasattr(cfg.optimizer, "_name") else cfg.optimizer)
    if name not in mp.OPTIMIZER_STATE:
        raise PlanError(
            f"--optimizer {name}: plan knows the state of {', '.join(sorted(mp.OPTIMIZER_STATE))}: use one of them"
        )
    o = cfg.optimizer
    options = {
        "amsgrad": bool(getattr(o, "amsgrad", False)),
        "momentum": float(getattr(o, "momentum", 0) or 0),
        "beta1": getattr(o, "beta1", None),
        "adafactor_unfactored": not bool(getattr(o, "factored", True)) if name == "adafactor" else False,
    }
    return name, options


def worker_bytes(shapes, layout, precision, optimizer, options, rank=0) -> dict:
    """What worker ``rank`` holds under ``layout``: Held for "shared" and "expert", and "buffers"
    (legacy_ddp's all-reduce buffer: min(2**28, this worker's parameters) in the model's dtype)."""
    held = mp.held_shapes(shapes, layout, rank)
    flat = precision.name == "fp16" and layout.world_size == 1  # hook 12: per-parameter on >1 workers
    out = {side: mp.held_bytes(held[side], layout, precision, optimizer, options, flat) for side in held}
    out["buffers"] = 0
    if layout.backend == "legacy_ddp" and layout.world_size > 1:
        mine = sum(math.prod(s) for side in held.values() for s in side)
        out["buffers"] = min(2**28, mine) * precision.param_bytes
    return out


def plan_rows(
    shapes, units, precision, optimizer, options, world, refused, activation, memory, teacher=0
) -> List[dict]:
    """One dict per layout: the bytes of worker 0 (the largest slices: torch.chunk gives the first
    ranks ceil(rows / W)). ``units``: (fully_sharded's unit numels, one MoE layer's expert numel); ``teacher``:
    the bytes a distillation teacher adds to every worker (teacher_plan.TeacherCost.total)."""
    units, expert_layer = units
    rows = []
    for layout in mp.layouts(world, *shapes.expert_counts):
        held = worker_bytes(shapes, layout, precision, optimizer, options)
        gathered = mp.gathered_unit_bytes(units, layout, precision)
        gathered += mp.gathered_expert_bytes(expert_layer, layout, precision)
        act = activation(layout)
        total = held["shared"].total + held["expert"].total + held["buffers"] + gathered + act + teacher
        note = []
        if layout.backend == "fully_sharded" and refused:
            note.append(f"refused on this build: {refused}")
        rows.append(dict(layout=layout, shared=held["shared"], expert=held["expert"], buffers=held["buffers"],
                         gathered=gathered, activations=act, teacher=teacher, total=total,
                         fits=[total <= m for m in memory], note=note))  # fmt: skip
    return rows


def format_rows(rows, header: List[str]) -> str:
    unit, name = (2**30, "GiB") if max(r["total"] for r in rows) >= 2**30 else (2**20, "MiB")
    size = lambda n: f"{n / unit:.2f}"
    lines = [*header, f"per worker, {name}: parameters/gradients/optimizer state of experts and of shared parameters"]
    teacher = any(r.get("teacher") for r in rows)  # a column of its own only with a distillation teacher
    column = lambda text: f"{text:>9}" if teacher else ""  # noqa: E731
    lines.append(
        f"{'backend':<14}{'P':>4} {'experts':<8}{'experts p/g/opt':>22}{'shared p/g/opt':>22}"
        f"{'master':>9}{'buffers':>9}{'activ.':>9}{column('teacher')}{'total':>10}  fits"
    )
    notes = []
    for r in rows:
        lay, s, e = r["layout"], r["shared"], r["expert"]
        pgo = lambda h: f"{size(h.params)}/{size(h.grads)}/{size(h.optimizer)}"
        fits = "/".join("yes" if f else "no" for f in r["fits"]) or "-"
        for note in r["note"]:
            if note not in notes:
                notes.append(note)
        if r["note"]:
            fits += " " + ",".join("*" * (notes.index(note) + 1) for note in r["note"])
        lines.append(
            f"{lay.backend:<14}{lay.parallel_size:>4} {'sharded' if lay.experts_sharded else 'whole':<8}"
            f"{pgo(e):>22}{pgo(s):>22}{size(s.master + e.master):>9}{size(r['buffers'] + r['gathered']):>9}"
            f"{size(r['activations']):>9}{column(size(r['teacher']))}{size(r['total']):>10}  {fits}"
        )
    lines += [f"{'*' * (i + 1)} {note}" for i, note in enumerate(notes)]
    return "\n".join(lines)


def predicted(argv: List[str], world_size: int, backend: str, parallel_size: int, rank: int) -> dict:
    """``worker_bytes`` for fairseq-train's ``argv`` (without ``plan``'s own flags): what the test
    compares with the bytes counted on real workers."""
    _, _, asked, fairseq_argv = split_argv([*argv, "--world-size", str(world_size)])
    cfg, _, model = build_on_meta(fairseq_argv, None)
    precision = mp.precision_of(lambda name: getattr(cfg.common, name, False))
    optimizer, options = optimizer_of(cfg)
    shapes = model_shapes(model)
    experts = "sharded" if asked.get("--moe-fully-sharded-experts") == "sharded" else "whole"
    layout = mp.Layout(world_size, parallel_size, backend=backend, experts=experts)
    return worker_bytes(shapes, layout, precision, optimizer, options, rank)


def main(argv: List[str], prog: str = "python -m fairseq_moe_ext plan") -> int:
    from ..parallel.fully_sharded import refused_options
    from .activation_bound import activation_bytes
    from .teacher_plan import teacher_cost

    logging.disable(logging.INFO)  # fairseq's and hydra's start-up notes: the table is the output
    warnings.filterwarnings("ignore")  # hydra's and torch's deprecation notes: the table is the output
    try:
        own, memory, asked, fairseq_argv = split_argv(argv, prog)
        cfg, args, task, model = build_task_and_model(fairseq_argv, own.dictionary_size)
        teacher = teacher_cost(cfg, task, own.world_size)
        shapes = model_shapes(model, dense=teacher is not None)
        precision = mp.precision_of(lambda name: getattr(cfg.common, name, False))
        optimizer, options = optimizer_of(cfg)
        if precision.name.startswith("memory_efficient") and optimizer in ("sgd", "adagrad", "adadelta"):
            raise PlanError(
                f"{precision.flag} needs an optimizer that keeps fp32 state for fp16 weights (fairseq refuses "
                f"--optimizer {optimizer} with it): use --optimizer adam, or drop {precision.flag}"
            )
        refused = (refused_options(args) or [""])[0].split(":")[0]
        activation = activation_bytes(cfg, model, shapes, precision)
        units = unit_numels(model)
        rows = plan_rows(
            shapes, units, precision, optimizer, options, own.world_size, refused, activation, memory,
            teacher=0 if teacher is None else teacher.total,
        )  # fmt: skip
    except (PlanError, ValueError) as error:
        print(f"plan: error: {error}", file=sys.stderr)
        return 2
    experts = sum(math.prod(s) for s in shapes.experts)
    shared = sum(math.prod(s) for s in shapes.shared)
    header = [
        f"model: {shared + experts:,} parameters ({shared:,} shared, {experts:,} {experts_per_layer(shapes)}); "
        f"{precision.flag}, --optimizer {optimizer}; W = {own.world_size}"
        + (f"; fits: {own.device_memory} ({', '.join(mp.gib(m) for m in memory)} GiB)" if memory else ""),
        f"worker 0 (the largest slices); activations: {activation.describe}",
    ]
    if teacher is not None:
        header.append(teacher.describe())
    if asked:
        header.append("asked: " + ", ".join(f"{k} {v}" for k, v in asked.items()) + " (plan shows every choice)")
    print(format_rows(rows, header))
    return 0
