"""--fp16 and --bf16 at inference run the MoE model in that dtype, in every entry point that loads one (generate,
interactive, validate, eval-lm, the hub interface), in one process and with experts sharded over 2 torchrun
workers: what the model computed in is read by forward hooks while it runs (tests/support/probes/fairseq_dtype_probe.py),
not from the flag. Routing and the balance bias stay float32. Stock fairseq casts only for --fp16 in its CLIs, and
not at all in the hub.

The sets: a translation and a language model trained one update in one process with --moe-balance bias, each
resharded into a 2-rank set (so 2 workers keep their experts sharded, and one process merges it).
"""

import json
import re

import pytest

from support.launch.fairseq_helpers import USER_DIR, run_checkpoint_tool, run_fairseq, torchrun
from support.launch.multiworker_cli_runs import moe_args
from support.launch.paths import PROBES

pytestmark = pytest.mark.slow
PROBE = PROBES / "fairseq_dtype_probe.py"
BIAS = ["--moe-balance", "bias", "--moe-bias-update-rate", "0.05"]
FLAGS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# fmt: off
LM_TRAIN = ["--task", "language_modeling", "--arch", "moe_transformer_lm_tiny", "--criterion", "moe_cross_entropy",
            "--tokens-per-sample", "32", "--optimizer", "adam", "--lr", "3e-3", "--max-tokens", "512",
            "--required-batch-size-multiple", "1"]
# fmt: on


def trained_set(root, name, train_args):
    """One update in one process, resharded into a 2-rank set: its checkpoint_last.pt."""
    run_fairseq("train", *train_args, "--no-epoch-checkpoints")
    path = root / f"{name}-set" / "checkpoint_last.pt"
    path.parent.mkdir()
    run_checkpoint_tool("reshard", root / name / "checkpoint_last.pt", path, "--world-size", "2", check=True)
    return path


@pytest.fixture(scope="module")
def sets(data, lm_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("dtype")
    translation = trained_set(root, "mt", moe_args(data, root / "mt", 1, *BIAS))
    # fmt: off
    lm = trained_set(root, "lm", [str(lm_data), "--user-dir", USER_DIR, "--cpu", "--num-workers", "0", *LM_TRAIN,
                                  *BIAS, "--max-update", "1", "--save-dir", str(root / "lm")])
    # fmt: on
    (root / "input.txt").write_text("s1 s2 s3 s4\ns5 s6\n")
    return {"root": root, "mt": translation, "lm": lm, "data": data, "lm_data": lm_data}


def cli_runs(sets, dtype, one_process):
    """The inference CLIs' runs (their command lines) in ``dtype``."""
    mt = [str(sets["data"]), "--user-dir", USER_DIR, "--path", str(sets["mt"]), "--cpu", "--num-workers", "0"]
    lm = [str(sets["lm_data"]), "--user-dir", USER_DIR, "--path", str(sets["lm"]), "--cpu", "--num-workers", "0"]
    flag = FLAGS[dtype]
    runs = {
        f"generate-{dtype}": [
            *mt,
            "--gen-subset",
            "valid",
            "--beam",
            "2",
            "--max-tokens",
            "300",
            "--max-len-b",
            "5",
            *flag,
        ],
        f"eval_lm-{dtype}": [*lm, "--tokens-per-sample", "32", "--max-tokens", "64", *flag],
    }
    if one_process:  # multi-worker validate on CPUs ends in fairseq's CUDA-only gather; interactive reads stdin
        input_file = str(sets["root"] / "input.txt")
        # fmt: off
        runs[f"interactive-{dtype}"] = [*mt, "--source-lang", "src", "--target-lang", "tgt", "--beam", "2",
                                         "--input", input_file, *flag]
        # fmt: on
        # fmt: off
        runs[f"validate-{dtype}"] = [*mt, "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
                                      "--valid-subset", "valid", "--max-tokens", "2000", *flag]
        # fmt: on
    return {name: {"tool": name.split("-")[0], "args": args} for name, args in runs.items()}


def hub_run(sets, dtype):
    overrides = {"fp16": {"fp16": True}, "bf16": {"bf16": True}, "fp32": {}}[dtype]
    return {
        "tool": "hub",
        "dir": str(sets["mt"].parent),
        "checkpoint_file": sets["mt"].name,
        "data": str(sets["data"]),
        "overrides": overrides,
        "sentence": "s1 s2 s3 s4",
    }


def probe(sets, workers, runs, tag):
    out = sets["root"] / tag
    output = torchrun(workers, PROBE, [out, json.dumps(runs)], timeout=300)
    return {
        name: [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(workers)] for name in runs
    }, output


@pytest.fixture(scope="module")
def one_process(sets):
    runs = {}
    for dtype in FLAGS:
        runs.update(cli_runs(sets, dtype, one_process=True))
        runs[f"hub-{dtype}"] = hub_run(sets, dtype)
    return probe(sets, 1, runs, "one")


@pytest.fixture(scope="module")
def two_workers(sets):
    records, output = {}, ""
    for dtype in ("fp16", "bf16"):
        # One torchrun per tool: eval-lm initialises distributed its own way (fairseq's call_main).
        for name, run in cli_runs(sets, dtype, one_process=False).items():
            got, said = probe(sets, 2, {name: run}, f"two-{name}")
            records.update(got)
            output += said
    return records, output


def assert_ran_in(record, dtype, router="float32"):
    seen, want = record["seen"], [DTYPES[dtype]]
    assert record["forwards"] > 0, "no MoE layer ran"
    for what in ("experts", "moe_input", "attention_weights", "attention_input", "output_logits"):
        assert seen.get(what) == want, (what, seen)
    assert seen["router_logits"] == [router], seen
    assert seen["balance_bias"] == ["float32"], seen


@pytest.mark.parametrize("dtype", list(FLAGS))
@pytest.mark.parametrize("tool", ["generate", "interactive", "validate", "eval_lm", "hub"])
def test_each_inference_entry_point_in_one_process_runs_the_model_in_the_dtype_asked(one_process, tool, dtype):
    (record,) = one_process[0][f"{tool}-{dtype}"]
    assert_ran_in(record, dtype)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("tool", ["generate", "eval_lm"])
def test_two_workers_with_experts_sharded_run_the_model_in_the_dtype_asked(two_workers, tool, dtype):
    for record in two_workers[0][f"{tool}-{dtype}"]:
        assert_ran_in(record, dtype)
    assert "expert-sharded inference: worker 1 of 2 holds experts 2..3" in two_workers[1]


def test_one_info_line_per_load_names_the_dtype_the_model_runs_in(one_process):
    lines = re.findall(
        r"the model runs in (\w+): weights (\w+), routing computed in float32, balance bias float32", one_process[1]
    )
    # Every CLI run and hub load in the module's one process: 5 entry points x 3 dtypes, one line each.
    assert sorted(lines) == sorted([(d, d) for d in DTYPES.values()] * 5), one_process[1][-3000:]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_sharded_worker_allocates_only_its_own_experts_in_the_dtype_it_runs_no_fp32_copy(two_workers, dtype):
    # The set's files are fp32 (4 experts per layer, 2 per worker): every expert tensor a worker allocates while
    # loading is one it keeps (2 experts), in the dtype it runs in (experts are the model's only 3-D tensors).
    for record in two_workers[0][f"generate-{dtype}"]:
        assert record["allocated"], "no expert tensor was allocated"
        assert {(d, s[0]) for d, s in record["allocated"]} == {(DTYPES[dtype], 2)}, record["allocated"]


def test_one_process_in_bf16_allocates_every_expert_once_in_bf16_never_in_fp32(one_process):
    (record,) = one_process[0]["generate-bf16"]
    assert {(d, s[0]) for d, s in record["allocated"]} == {("bfloat16", 4)}, record["allocated"]
