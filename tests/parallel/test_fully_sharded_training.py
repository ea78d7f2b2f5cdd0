"""What a user meets under ``--ddp-backend fully_sharded`` beyond one plain step, through fairseq's
own Trainer on 2 gloo workers: ``--update-freq`` reduce-scatters once per update (counted) and equals
one process; ``--checkpoint-activations`` and ``--moe-fully-sharded-unit model`` equal one process; ``--eval-bleu`` generates during
validation (fairseq's generator calls the encoder directly) and scores what one process scores; the
root keeps its parameters gathered between forward and backward, the layers do not.
"""

import json

import pytest

from support.launch.dist_utils import run_on_workers
from support.launch.in_process_trainer import (
    assert_step_equals_one_process,
    build_trainer,
    collate,
    micro_batches,
    one_step,
    replicated_case_flags,
    sentence_pairs,
    training_args,
    without_fully_sharded_options,
    write_dictionaries,
)

pytestmark = pytest.mark.slow
SHARES = [5, 7]
FULLY_SHARDED = ["--ddp-backend", "fully_sharded"]
# fmt: off
CASES = {  # name: (extra flags, micro-batches per update, FSDP units: root and layers, or the root alone)
    "update_freq": (["--update-freq", "2"], 2, 5),
    "checkpoint_activations": (["--checkpoint-activations"], 1, 5),
    "one_unit": (["--moe-fully-sharded-unit", "model"], 1, 1),
}
# fmt: on


def counting_reduce_scatters():
    """Every reduce-scatter FSDP2 issues (one per unit per backward that syncs), counted."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    calls = [0]
    original = _fsdp_param_group.foreach_reduce

    def foreach_reduce(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    _fsdp_param_group.foreach_reduce = foreach_reduce
    return calls


def training_cases_worker(rank, world, data_dir):
    from fairseq_moe_ext.parallel import fully_sharded

    calls = counting_reduce_scatters()
    results = {}
    for name, (extra, count, _) in CASES.items():
        task, trainer = build_trainer(training_args(data_dir, world, [*FULLY_SHARDED, *extra]))
        start = sum(SHARES[:rank])
        batches = [b[start : start + SHARES[rank]] for b in micro_batches(SHARES, count)]
        attention = []  # forward calls of the first layer's attention: twice per micro-batch if recomputed
        trainer.get_model().encoder.layers[0].self_attn.register_forward_hook(lambda *_: attention.append(1))
        calls[0] = 0
        result = one_step(task, trainer, *batches)
        result["attention_calls"] = len(attention)
        result["reduce_scatters"] = calls[0]
        result["units"] = len(fully_sharded.fsdp_modules(trainer.get_model()))
        result["params"] = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in result["params"].items()}
        modules = fully_sharded.fsdp_modules(trainer.get_model())
        result["reshards"] = [fully_sharded._reshards_after_forward(m) for m in modules]
        results[name] = result
    return results


def test_update_freq_checkpointing_and_one_unit_under_fully_sharded_equal_one_process(tmp_path):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    by_rank = run_on_workers(training_cases_worker, 2, data_dir)
    for name, (extra, count, units) in CASES.items():
        results = [r[name] for r in by_rank]
        assert_step_equals_one_process(results, data_dir, SHARES, replicated_case_flags(4, None, extra), count, 2)
        for r in results:  # each unit reduce-scatters once per update
            assert r["units"] == units and r["reduce_scatters"] == units, (name, r["units"], r["reduce_scatters"])
            # the root keeps its parameters gathered from forward to backward, the layers do not
            assert r["reshards"] == [False] + [True] * (units - 1), (name, r["reshards"])
    assert [r["update_freq"]["attention_calls"] for r in by_rank] == [2, 2], "one forward per micro-batch"
    assert [r["checkpoint_activations"]["attention_calls"] for r in by_rank] == [2, 2], "forward, then recomputed"


BLEU = ["--eval-bleu", "--eval-bleu-args", json.dumps({"beam": 2, "max_len_a": 1.2, "max_len_b": 6})]


def bleu_statistics(task, trainer, pairs):
    """fairseq's validation step on ``pairs``: the BLEU counts it logs (generation inside)."""
    trainer.model.eval()
    _, _, logging_output = task.valid_step(collate(task, pairs), trainer.model, trainer.criterion)
    return {k: v for k, v in logging_output.items() if k.startswith("_bleu")}


def eval_bleu_worker(rank, world, data_dir, precision):
    task, trainer = build_trainer(training_args(data_dir, world, [*FULLY_SHARDED, *BLEU, *precision]))
    pairs = sentence_pairs(12)
    first = bleu_statistics(task, trainer, pairs[6 * rank : 6 * rank + 6 - 3 * rank])  # 6 and 3 sentences
    one_step(task, trainer, pairs[6 * rank : 6 * rank + 6])  # training goes on after generating
    return {"bleu": first, "sharded": [type(p).__name__ for p in trainer.get_model().parameters()]}


# bf16: the worker with fewer sentences joins the others' MoE calls with no rows, in their dtype
# (fp32 rows were a collective size mismatch that aborted both workers). Experts sharded over both
# workers (P = 1): those calls run the experts alone, so the units' recorded forwards differ between
# the workers (they must not steer the next backward's prefetch: it waited forever).
EXPERTS_SHARDED = ["--moe-expert-parallel-size", "1", "--moe-fully-sharded-experts", "sharded"]


@pytest.mark.parametrize("precision", [[], ["--bf16"], EXPERTS_SHARDED], ids=["fp32", "bf16", "experts_sharded"])
def test_eval_bleu_under_fully_sharded_generates_what_one_process_generates(tmp_path, precision):
    data_dir = str(tmp_path / "data")
    write_dictionaries(data_dir)
    by_rank = run_on_workers(eval_bleu_worker, 2, data_dir, precision)
    task, trainer = build_trainer(training_args(data_dir, 1, [*BLEU, *without_fully_sharded_options(precision)]))
    pairs = sentence_pairs(12)
    for rank, result in enumerate(by_rank):
        want = bleu_statistics(task, trainer, pairs[6 * rank : 6 * rank + 6 - 3 * rank])
        assert want["_bleu_sys_len"] > 0 and result["bleu"]["_bleu_sys_len"] > 0, (rank, result["bleu"], want)
        if "--bf16" not in precision:  # bf16: an untrained model's near-ties round apart (other expert batches)
            assert result["bleu"] == want, (rank, result["bleu"], want)
        assert "DTensor" in result["sharded"], "the shared part is sharded again after generating"
