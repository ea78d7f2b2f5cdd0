"""The recipes, end to end, in their tiny modes: every stage runs on this machine and leaves the
outputs the README promises (checkpoint sets, generation with BLEU, perplexities, plots, summaries).

Each recipe runs as a user would run it (`bash recipes/X.sh`), in a temporary WORK directory,
with the virtual environment that runs these tests.
"""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.launch.fairseq_helpers import fairseq_env, tail
from support.launch.paths import REPO_ROOT as ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_recipe(script: str, work: Path, *args: str, timeout: float = 240, **env: str) -> str:
    environment = dict(fairseq_env(), WORK=str(work), **env)
    if sys.prefix != sys.base_prefix:  # reuse the venv running the tests (recipes/lib/venv.sh)
        environment["MOE_VENV"] = sys.prefix
    command = ["bash", str(ROOT / "recipes" / script), *args]
    try:
        done = subprocess.run(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            env=environment,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as timed_out:
        output = timed_out.stdout.decode(errors="replace") if isinstance(timed_out.stdout, bytes) else timed_out.stdout
        pytest.fail(f"{script} ran past {timeout}s\n{tail(output or '', 60)}", pytrace=False)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {done.returncode}\n{tail(done.stdout, 60)}", pytrace=False)
    return done.stdout


def assert_set(save_dir: Path, world_size: int = 2) -> dict:
    manifest = json.loads((save_dir / "checkpoint_best.set.json").read_text())
    assert manifest["world_size"] == world_size
    assert sorted(entry["rank"] for entry in manifest["files"]) == list(range(world_size))
    for entry in manifest["files"]:
        assert (save_dir / entry["name"]).stat().st_size == entry["bytes"]
    return manifest


def assert_job_not_run_again(output: str) -> None:
    """The main job's steps were up to date (tiny_job made them): its corpus, sentencepiece, binarised data, MoE
    training, test generation, routing and load plot each said so, and nothing trained."""
    job = output[output.index("==> [1/11] environment") : output.index("==> done in")]
    assert job.count("up to date (remove") == 7 and "begin training epoch" not in job, job[-3000:]


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000, path


def hypotheses(generate_out: Path) -> list:
    return [line for line in generate_out.read_text().splitlines() if line.startswith("H-")]


# The main job's tiny mode on 2 dialects (the pruning and distillation recipes' corpus), run once: its own test reads
# what it wrote, then expert_pruning.sh and distillation.sh run on in the same WORK, where every step of the job is
# up to date (their tests check that it is not run again).
TINY_JOB = dict(TINY="1", DIALECTS="2")


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    work = tmp_path_factory.mktemp("recipes") / "main"
    output = run_recipe("main.sh", work, **TINY_JOB)
    # the recipes that run on rewrite the summary without the dense baselines: kept as the job wrote it
    summary = {name: (work / name).read_text() for name in ("summary.txt", "summary.json")}
    return SimpleNamespace(work=work, output=output, summary=summary)


@pytest.mark.slow
def test_main_job_tiny_mode_trains_moe_and_both_dense_baselines_generates_scores_and_plots(tiny_job):
    work, output = tiny_job.work, tiny_job.output
    for stage in range(1, 12):
        assert f"==> [{stage}/11]" in output
    debug = [line for line in output.splitlines() if "DEBUG:" in line]
    assert not debug, "library debug lines in the job's output:\n" + "\n".join(debug[:10])

    assert_set(work / "moe" / "ckpt")
    test_lines = len((work / "data" / "raw" / "test.tgt").read_text().splitlines())
    domains = set((work / "data" / "raw" / "test.domain").read_text().split())
    for run in ("moe", "dense", "dense_matched"):
        assert "BLEU4" in (work / run / "generate.out").read_text().splitlines()[-1]
        assert len(hypotheses(work / run / "generate.out")) == test_lines
        bleu = json.loads((work / run / "bleu.json").read_text())
        assert 0 <= bleu["bleu"] <= 100 and set(bleu["by_domain"]) == domains

    assert_png(work / "plots" / "expert_load.png")
    assert_png(work / "plots" / "routing_by_domain.png")
    routing = json.loads((work / "routing.json").read_text())
    assert set(routing["layers"]) == {"enc1", "dec1"} and set(routing["domains"]) == domains
    for layer in routing["layers"].values():
        assert all(sum(row) == pytest.approx(1.0, abs=1e-3) for row in layer["share"])
        assert 0.0 <= layer["mi_fraction"] <= 1.0

    summary = tiny_job.summary["summary.txt"]
    assert "test BLEU (sacrebleu)" in summary and "MoE" in summary and "dense_matched" in summary
    assert "FLOPs per token, encoder" in summary and "FLOPs per token, decoder" in summary
    for baseline in ("dense", "dense_matched"):
        assert f"MoE - {baseline}: " in summary
    costs = json.loads(tiny_job.summary["summary.json"])
    moe, dense, matched = costs["MoE"], costs["dense"], costs["dense_matched"]
    # The TINY shape: width 64, 2 layers per side, FFN_DIM 128, k=2, every 2nd layer MoE with E=8.
    for side in ("encoder_flops", "decoder_flops"):
        # dense_matched's FFNs are 2 x 128 wide in both layers: 2 layers x 2 matrices x 64 x 128 more, x 2 FLOPs.
        assert matched[side] - dense[side] == 2 * 2 * 64 * 128 * 2
        # The MoE's layer 1 runs k=2 experts of 128 plus a router of 8 x 64; its layer 0 is dense_matched's half.
        assert moe[side] == matched[side] - 2 * 64 * 128 * 2 + 8 * 64 * 2
    assert dense["flops"] < moe["flops"] < matched["flops"] and moe["active"] < moe["total"]
    assert "balance loss" in summary and "dropped fraction" in summary and "enc1: I =" in summary
    assert summary in output  # the summary is also what the job prints last


@pytest.mark.slow
def test_iwslt14_dry_run_trains_in_one_process_and_generates_with_bleu(tmp_path):
    work = tmp_path / "iwslt"
    run_recipe("iwslt14_de_en.sh", work, "--dry-run")
    assert '"valid_bleu"' in (work / "moe" / "train.log").read_text()  # EVAL_BLEU=1 by default, as in the README
    assert (work / "moe" / "ckpt" / "checkpoint_best.pt").is_file()  # one process: fairseq's single file
    assert "Generate test with beam=5: BLEU4" in (work / "moe" / "bleu.txt").read_text()
    assert len(hypotheses(work / "moe" / "generate.out")) == 40


@pytest.mark.slow
def test_wmt16_dry_run_trains_on_two_workers_and_scores_compound_split_bleu(tmp_path):
    work = tmp_path / "wmt"
    run_recipe("wmt16_en_de.sh", work, "--dry-run")
    assert_set(work / "moe" / "ckpt")
    assert (work / "moe" / "bleu.txt").read_text().startswith("BLEU4 = ")
    assert len(hypotheses(work / "moe" / "generate.out")) == 40


@pytest.mark.slow
def test_wikitext103_dry_run_trains_on_two_workers_and_reports_perplexity(tmp_path):
    work = tmp_path / "wiki"
    run_recipe("wikitext103_lm.sh", work, "--dry-run")
    assert_set(work / "moe" / "ckpt")
    assert "Perplexity:" in (work / "moe" / "perplexity.txt").read_text()


@pytest.mark.slow
def test_python_stdlib_lm_quick_mode_compares_moe_and_dense_perplexity(tmp_path):
    work = tmp_path / "stdlib"
    run_recipe("python_stdlib_lm.sh", work, QUICK="1")
    assert_set(work / "moe" / "ckpt")
    for run in ("moe", "dense"):
        for split in ("valid", "test"):
            assert "Perplexity:" in (work / run / f"eval_{split}.log").read_text()
    summary = (work / "summary.txt").read_text()
    assert "valid perplexity" in summary and "test perplexity" in summary and "nan" not in summary
    assert_png(work / "plots" / "expert_load.png")


def run_nllb_dry_run(work: Path, variant: str, **knobs: str) -> str:
    """nllb_moe.sh --dry-run on a lookalike of the release (TINY_VARIANT): the import, and generation in one process
    and on 2 workers, checked; the recipe's output."""
    output = run_recipe("nllb_moe.sh", work, "--dry-run", timeout=540, TINY_VARIANT=variant, **knobs)
    for stage in range(1, 6):
        assert f"==> [{stage}/5]" in output
    imported = (work / "imported" / "import.log").read_text()
    # laid out as the downloads unpack: MODEL_DIR holds the tarball's model_moe_54b/, the dictionary and langs.txt
    assert (work / "tiny_nllb" / "model_moe_54b" / "checkpoint_2_300000-shared.pt").is_file()
    assert f"rank files + checkpoint_2_300000-shared.pt in {work / 'tiny_nllb' / 'model_moe_54b'}" in output
    if variant == "replicas":
        assert "8 rank files + shared" in imported and "4 experts (2 replicas each)" in imported
        assert "NOTE 4 of the run's 8 rank files are here" not in imported
    else:  # the first E rank files of the 2E-worker run: every expert, with one NOTE
        assert "4 rank files + shared" in imported and "NOTE 4 of the run's 8 rank files are here" in imported
    # NLLB's langs.txt is one comma line: 3 languages, then the 3 data-source tags, which the task must add
    assert "+ 3 language tokens + 3 data-source tags = 70 rows" in imported and "--moe-eom 0.2" in imported
    assert "wrote " in imported and "imported/model.set.json" in imported  # imported for GPUS=2 workers
    assert len(hypotheses(work / "generate.out")) == 8  # one process: the tiny set's 8 test sentences
    assert len(hypotheses(work / "generate-sharded.out")) == 8  # 2 workers, each its own sentences
    assert "expert-sharded inference: worker 1 of 2 holds experts 2..3" in (work / "generate-sharded.out").read_text()
    return output


@pytest.mark.slow
def test_nllb_moe_dry_run_imports_the_first_half_of_the_rank_files_and_generates_two_ways(tmp_path):
    """The release as transformers' converter reads it (rank files 0..E-1 only) differs from the whole release up
    to the import: the stages after generation, which the whole release's dry run covers, are off."""
    work = tmp_path / "nllb"
    output = run_nllb_dry_run(work, "first-half", PRUNE="0", PRECISION_CHECK="0", DISTILL="0", FINETUNE="0")
    assert "skipped (FINETUNE=0)" in output and not (work / "pruned").exists() and not (work / "distil").exists()


@pytest.mark.slow
def test_nllb_moe_dry_run_imports_the_lookalike_generates_prunes_distils_and_fine_tunes(tmp_path):
    work = tmp_path / "nllb"
    output = run_nllb_dry_run(work, "replicas")
    # The precision check: --fp16 and --bf16 generation in one process ran the model in that dtype (its log line).
    assert "--fp16: the model ran in float16; 8 hypotheses" in output
    assert "--bf16: the model ran in bfloat16; 8 hypotheses" in output
    log = (work / "finetune" / "train.log").read_text()
    assert "Loaded checkpoint" in log and "(epoch 2 @ 0 updates)" in log  # restored, reset_all as NLLB's README
    assert "num_updates: 3 >= max_update: 3" in log
    assert "'moe_gate_loss_combine_method': sum," in log  # the release's, kept by the import (checkpoint_flags)
    assert_set(work / "finetune" / "ckpt")  # fine-tuned on the GPUS=2 workers, saved as a 2-file set
    # the prune step: statistics of the pair eng_Latn-fra_Latn, half of the 4 experts kept, generation from them
    stats = json.loads((work / "pruned" / "stats.json").read_text())
    encoder, decoder = (e["groups"] for e in sorted(stats["layers"].values(), key=lambda e: e["side"] != "encoder"))
    assert set(encoder) == {"eng_Latn"} and set(decoder) == {"fra_Latn"}
    manifest = json.loads((work / "pruned" / "model.set.json").read_text())
    assert set(manifest["num_experts"].values()) == {2} and manifest["pruned"]["groups"] == ["eng_Latn", "fra_Latn"]
    assert len(hypotheses(work / "generate_pruned.out")) == 8 and "| 0.5 | 2 |" in output
    # the distillation step: a dense student of the import, the teacher's 4 experts spread over the 2 workers
    assert "its experts spread over 2 workers" in (work / "distil" / "train.log").read_text()
    assert "num_updates: 3 >= max_update: 3" in (work / "distil" / "train.log").read_text()
    assert len(hypotheses(work / "generate_student.out")) == 8


def test_nllb_langs_gives_stock_fairseq_one_comma_list_and_refuses_a_code_twice_in_one_line(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "recipes"))
    from nllb_langs import main

    (tmp_path / "langs.txt").write_text("eng_Latn,fra_Latn\ndeu_Latn\n")
    assert main([str(tmp_path / "langs.txt")]) == 0
    assert capsys.readouterr().out == "eng_Latn,fra_Latn,deu_Latn\n"
    (tmp_path / "langs.txt").write_text("eng_Latn,fra_Latn,eng_Latn\n")
    assert main([str(tmp_path / "langs.txt")]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and len(printed.err.strip().splitlines()) == 1, printed.err
    assert "eng_Latn is listed twice (codes 1 and 3)" in printed.err


def test_nllb_moe_without_the_downloaded_files_says_where_to_get_them(tmp_path):
    done = subprocess.run(
        ["bash", str(ROOT / "recipes" / "nllb_moe.sh")],
        capture_output=True,
        text=True,
        env=dict(fairseq_env(), WORK=str(tmp_path / "w"), MODEL_DIR=str(tmp_path / "none"), MOE_VENV=sys.prefix),
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "checkpoint_2_300000-shared.pt is missing: download https://tinyurl.com/nllb200moe54bmodel" in done.stderr


@pytest.mark.parametrize("script", ["iwslt14_de_en.sh", "wmt16_en_de.sh", "wikitext103_lm.sh", "nllb_moe.sh"])
def test_real_data_recipes_document_themselves_and_refuse_unknown_arguments(script):
    shown = subprocess.run(["bash", str(ROOT / "recipes" / script), "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and "--dry-run" in shown.stdout and "Knobs" in shown.stdout
    refused = subprocess.run(["bash", str(ROOT / "recipes" / script), "--dryrun"], capture_output=True, text=True)
    assert refused.returncode == 2 and "unknown argument --dryrun" in refused.stderr


@pytest.mark.slow
def test_expert_pruning_tiny_mode_prunes_per_dialect_globally_and_at_random_and_tables_bleu(tiny_job):
    work = tiny_job.work
    output = run_recipe("expert_pruning.sh", work, **TINY_JOB, FRACTIONS="0.5", SEEDS="1", RATIOS="3 9", timeout=600)
    assert_job_not_run_again(output)
    results = json.loads((work / "pruning" / "results.json").read_text())
    dialects = set((work / "data" / "raw" / "test.domain").read_text().split())
    row = results["by_fraction"]["0.5"]
    assert set(row) == dialects | {"mean"} and set(results["full"]) == dialects | {"mean"}
    for dialect in dialects:
        assert all(0 <= row[dialect][kind] <= 100 for kind in ("dialect", "global", "random"))
        manifest = json.loads((work / "pruning" / "sets" / f"{dialect}_keep0.5" / "checkpoint.set.json").read_text())
        assert manifest["pruned"]["groups"] == [dialect] and set(manifest["num_experts"].values()) == {4}
    assert "| mean |" in (work / "pruning" / "table.md").read_text() and "per-dialect" in output
    assert_png(work / "pruning" / "pruning.png")
    # RATIOS: R = 3 splits 4 + 4 of 8 experts as 6:2; R = 9 (7:1, the decoder below k) is refused and left out
    budgets = results["per_side_budgets"]
    assert [(row["ratio"], row["split"]) for row in budgets] == [(3.0, "6:2")]
    assert (
        set(budgets[0]["dialect"]) == dialects and "| 50% | 3 | 6:2 |" in (work / "pruning" / "budgets.md").read_text()
    )


@pytest.mark.slow
def test_distillation_tiny_mode_writes_every_table_and_restarts_without_regenerating(tiny_job):
    """``distillation.sh all`` on the tiny job: dense students from scratch, word- and sequence-level distilled from
    its MoE, a pruned set healed (expert_pruning.sh --heal), the cost; each table under its measurement line; a rerun
    of the students generates no finished shard and no student's test set again."""
    work = tiny_job.work
    healed_dialect = (work / "data" / "raw" / "test.domain").read_text().split()[0]  # one of the two: each heals alike
    env = dict(TINY_JOB, FRACTIONS="0.5", SEEDS="1", STUDENT_SEEDS="1", SHARD_LINES="50", HEAL_DIALECTS=healed_dialect)
    output = run_recipe("distillation.sh", work, "all", timeout=1500, **env)
    assert_job_not_run_again(output)
    out = work / "distillation"
    students = (out / "students.md").read_text()
    assert students.startswith("Measured ") and "load average (1, 5, 15 min) before" in students
    for kind in ("from scratch", "word-level distilled", "sequence-level distilled"):
        assert f"| dense student, {kind} |" in students, students
    for name in ("scratch_1", "word_1", "seq_1"):
        assert 0 <= json.loads((out / "runs" / name / "bleu.json").read_text())["bleu"] <= 100
    assert "its experts spread over 2 workers" in (out / "runs" / "word_1" / "train.log").read_text()
    shards = sorted((out / "seq_data" / "shards").glob("*.hyp"))  # every training sentence, in shards of 50
    sentences = len((work / "data" / "tok" / "train.src").read_text().splitlines())
    assert len(shards) == -(-sentences // 50) > 1 and sum(len(p.read_text().splitlines()) for p in shards) == sentences
    cost = json.loads((out / "cost.json").read_text())
    assert cost["plain_wps"] > 0 and cost["distilled_wps"] > 0 and "sentences/s" in cost["generation"]
    healed = (work / "pruning" / "healed.md").read_text()
    assert healed.startswith("Measured ") and "healed (distilled)" in healed and "sequence-level" in output
    healed_rows = json.loads((work / "pruning" / "healed.json").read_text())["by_fraction"]["0.5"]
    assert set(healed_rows) == {healed_dialect, "mean"}  # HEAL_DIALECTS: that dialect's set alone
    assert set(healed_rows["mean"]) == {"full", "pruned", "plain", "healed"}
    written = {path: path.stat().st_mtime_ns for path in [shards[0], *(out / "runs").glob("*_1/generate.out")]}
    again = run_recipe("distillation.sh", work, "students", timeout=900, **env)
    assert "up to date" in again and "shard 1/" not in again
    assert {path: path.stat().st_mtime_ns for path in written} == written  # no shard, no student's test set again
