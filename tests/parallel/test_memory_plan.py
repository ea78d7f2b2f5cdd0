"""``python -m fairseq_moe_ext plan`` predicts exactly the parameter, gradient, master-copy and
optimizer bytes a worker holds: two gloo workers each run one real ``Trainer.train_step`` and count
their tensors (tests/support/oracles/memory_counts.py), for every backend and precision this build trains;
plan's prediction for the same arguments (the model built on the meta device) must equal the count
on each worker, shared and expert parts apart, and legacy_ddp's all-reduce buffer too.

fully_sharded is counted with experts whole and, at P = 1 < W, with experts sharded over their
replica group (``--moe-fully-sharded-experts sharded``: each worker holds half of its experts' rows,
their gradients and their optimizer state); three cases give the encoder 4 experts and the decoder 2
(``--encoder-moe-expert-count``/``--decoder-moe-expert-count``). A row refused on this build (fully_sharded.refused_options)
is skipped while refused.
"""

import argparse

import pytest

from support.launch.dist_utils import run_on_workers
from support.launch.in_process_trainer import build_trainer, collate, sentence_pairs, training_args, write_dictionaries
from support.oracles.memory_counts import KINDS, counted_bytes, cpu_precision_shims

pytestmark = pytest.mark.slow

WORLD = 2
ADAM = ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)"]
PRECISIONS = {
    "fp32": [],
    "fp16": ["--fp16"],
    "bf16": ["--bf16"],
    "memory_efficient_fp16": ["--memory-efficient-fp16"],
    "memory_efficient_bf16": ["--memory-efficient-bf16"],
    "amp": ["--amp"],
}
SIDES = ["--encoder-moe-expert-count", "4", "--decoder-moe-expert-count", "2"]
# (backend, precision, optimizer flags (and SIDES), expert-parallel size): P = 2 = W by default, P = 1 replicates.
# fmt: off
CASES = [
    *[("legacy_ddp", precision, ADAM, 2) for precision in PRECISIONS],
    ("legacy_ddp", "fp32", ["--optimizer", "adafactor", "--lr", "0.001"], 1),  # factored moments, replicas
    ("legacy_ddp", "fp16", ["--optimizer", "nag", "--lr", "0.1"], 1),  # one momentum buffer on fp32 masters
    *[("fully_sharded", precision, ADAM, 2) for precision in PRECISIONS],
    ("fully_sharded", "fp32", ["--optimizer", "nag", "--lr", "0.1"], 1),
    # P = 1 < W: experts sharded over their replica group (the world here), 2 of the 4 experts' rows each.
    *[("experts_sharded", precision, ADAM, 1) for precision in ("fp32", "bf16", "amp")],
    # Encoder and decoder with different expert counts (4 and 2): P divides both.
    ("legacy_ddp", "fp16", [*ADAM, *SIDES], 2),
    ("fully_sharded", "bf16", [*ADAM, *SIDES], 2),
    ("experts_sharded", "fp32", [*ADAM, *SIDES], 1),
]
# fmt: on


BACKENDS = {
    "legacy_ddp": ["--ddp-backend", "legacy_ddp"],
    "fully_sharded": ["--ddp-backend", "fully_sharded"],
    "experts_sharded": ["--ddp-backend", "fully_sharded", "--moe-fully-sharded-experts", "sharded"],
}


def case_flags(backend, precision, optimizer, parallel):
    return [
        *BACKENDS[backend],
        "--moe-expert-parallel-size",
        str(parallel),
        "--clip-norm",
        "0",
        *PRECISIONS[precision],
        *optimizer,
    ]


def argv_of(data_dir, flags):
    """The oracle's training flags with the case's optimizer in place of its SGD."""
    argv = training_args(data_dir, WORLD, [])
    start = argv.index("--optimizer")
    del argv[start : start + 2]
    del argv[argv.index("--momentum") : argv.index("--momentum") + 2]
    del argv[argv.index("--clip-norm") : argv.index("--clip-norm") + 2]
    return [*argv, *flags]


def refusal(backend, precision):
    from fairseq_moe_ext.parallel.fully_sharded import refused_options

    if backend == "legacy_ddp":
        return None
    flags = argparse.Namespace(**{p: p == precision for p in PRECISIONS if p != "fp32"})
    refused = refused_options(flags)
    return refused[0] if refused else None


def counting_worker(rank, world, data_dir, cases):
    from fairseq.distributed.legacy_distributed_data_parallel import LegacyDistributedDataParallel

    from fairseq_moe_ext.parallel import fully_sharded

    results = []
    for flags in cases:
        task, trainer = build_trainer(argv_of(data_dir, flags))
        cpu_precision_shims(trainer, flags)
        pairs = sentence_pairs(12)
        trainer.train_step([collate(task, pairs[6 * rank : 6 * rank + 6])])
        counted = counted_bytes(trainer)
        legacy = [m for m in trainer.model.modules() if isinstance(m, LegacyDistributedDataParallel)]
        buffer = legacy[0].buffer if legacy else None
        counted["buffers"] = 0 if buffer is None else buffer.numel() * buffer.element_size()
        counted["steps"] = trainer.get_num_updates()
        counted["held"] = fully_sharded.held_bytes(trainer.get_model(), trainer.optimizer.optimizer)
        results.append(counted)
    return results


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """Every runnable case counted on the same two workers (one start-up for all)."""
    data_dir = str(tmp_path_factory.mktemp("plan") / "data")
    write_dictionaries(data_dir)
    runnable = [c for c in CASES if refusal(c[0], c[1]) is None]
    by_rank = run_on_workers(counting_worker, WORLD, data_dir, [case_flags(*c) for c in runnable])
    return data_dir, {case[:2] + (tuple(case[2]), case[3]): [r[i] for r in by_rank] for i, case in enumerate(runnable)}


@pytest.mark.parametrize(
    "backend, precision, optimizer, parallel",
    CASES,
    ids=[f"{b}-{p}-{o[1]}{'-sides' if SIDES[0] in o else ''}-P{s}" for b, p, o, s in CASES],
)
def test_plan_predicts_the_bytes_each_worker_holds_after_a_training_step(counted, backend, precision, optimizer, parallel):  # fmt: skip
    from fairseq_moe_ext.training.plan_cli import predicted

    refused = refusal(backend, precision)
    if refused:
        pytest.skip(f"refused on this build: {refused.split(':')[0]}")
    data_dir, results = counted
    workers = results[(backend, precision, tuple(optimizer), parallel)]
    argv = argv_of(data_dir, case_flags(backend, precision, optimizer, parallel))
    for rank, count in enumerate(workers):
        assert count["steps"] == 1, "the step was skipped (an overflow): the optimizer state was never built"
        want = predicted(argv, WORLD, BACKENDS[backend][1], parallel, rank)
        for side in ("shared", "expert"):
            got = {kind: count[side][kind] for kind in KINDS}
            held = want[side]
            assert got == {kind: getattr(held, kind) for kind in KINDS}, f"rank {rank}, {side}"
            assert got["params"] > 0 and (got["optimizer"] > 0) == (optimizer != ["--optimizer", "sgd"])
        assert count["buffers"] == want["buffers"], f"rank {rank}: legacy_ddp's all-reduce buffer"
        if not PRECISIONS[precision]:  # fp32: fully_sharded.held_bytes counts the same tensors
            kinds = [f"{side}_{kind}" for side in ("shared", "expert") for kind in ("params", "grads", "optimizer")]
            counted_here = {key: count[key.split("_")[0]][key.split("_")[1]] for key in kinds}
            assert counted_here == {key: count["held"][key] for key in kinds}, f"rank {rank}"


def test_plan_prints_every_backend_and_parallel_size_and_whether_each_fits(tmp_path, capsys):
    """W = 4, E = 4: P in {1, 2, 4}; legacy_ddp and fully_sharded for each, experts sharded where W > P.
    Dropless routing bounds a worker's expert rows by every slot of its P-worker group, so the
    activation bound grows with P."""
    from fairseq_moe_ext.training.plan_cli import main

    argv = argv_of(str(tmp_path / "absent"), ["--max-tokens", "64", *ADAM])
    assert main([*argv, "--dictionary-size", "30", "--world-size", "4", "--device-memory", "1MB,10GiB"]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in table if line.startswith(("legacy_ddp", "fully_sharded"))]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (backend, p, experts)
        for p in ("1", "2", "4")
        for backend, experts in (("legacy_ddp", "whole"), ("fully_sharded", "whole"), ("fully_sharded", "sharded"))
        if not (p == "4" and experts == "sharded")
    ]
    assert all(r[9] == "no/yes" for r in rows), table
    activations = {r[1]: float(r[7]) for r in rows if r[0] == "legacy_ddp"}
    assert activations["1"] < activations["2"] < activations["4"], table


def test_plan_takes_each_sides_expert_count_and_offers_every_p_dividing_both(tmp_path, capsys):
    """--encoder-moe-expert-count 4 --decoder-moe-expert-count 2 on W = 4: P in {1, 2} (gcd(4, 4, 2) = 2), and
    the header names each side's count."""
    from fairseq_moe_ext.training.plan_cli import main

    argv = argv_of(str(tmp_path / "absent"), ["--max-tokens", "64", *ADAM, *SIDES])
    assert main([*argv, "--dictionary-size", "30", "--world-size", "4"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "in experts: 4 per encoder MoE layer, 2 per decoder MoE layer" in table[0], table[0]
    rows = [line.split() for line in table if line.startswith(("legacy_ddp", "fully_sharded"))]
    assert sorted({r[1] for r in rows}) == ["1", "2"], table


def test_plan_by_dictionary_size_sizes_the_embeddings_and_writes_no_file_anywhere(tmp_path, capsys, monkeypatch):
    """--dictionary-size 256206 (NLLB-200's vocabulary) and no data directory: the dictionaries are held in
    memory, so a plan needs no temporary directory (here a regular file: making one there fails) and leaves
    nothing behind; the shared parameters grow by whole embedding tables of that many rows."""
    import tempfile

    from fairseq_moe_ext.training.plan_cli import main

    blocked = tmp_path / "no-temporary-directory"
    blocked.write_text("a file")
    monkeypatch.setattr(tempfile, "tempdir", str(blocked))
    argv = argv_of(str(tmp_path / "absent"), ["--max-tokens", "64", *ADAM])
    shared = {}
    for size in (30, 256206):
        assert main([*argv, "--dictionary-size", str(size), "--world-size", "2"]) == 0
        header = capsys.readouterr().out.splitlines()[0]
        shared[size] = int(header.split("(")[1].split(" shared")[0].replace(",", ""))
    tables, rest = divmod(shared[256206] - shared[30], (256206 - 30) * 64)  # moe_transformer_tiny: 64 wide
    assert rest == 0 and tables in (1, 2, 3), shared
    assert list(tmp_path.iterdir()) == [blocked]
