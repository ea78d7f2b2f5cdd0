"""The GPU one-shot (benchmarks/gpu_oneshot.sh) is ready for the first lent GPU: its CPU dry run
passes every check a CPU can run under the GPU machine's package list, says SKIP (cuda) for the
rest, keeps to the deadline and to what $OUT may hold, and a missing python or torch is said as such."""

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from support.launch.paths import REPO_ROOT as ROOT

ONESHOT = ROOT / "benchmarks" / "gpu_oneshot.sh"


def load_scale():
    """How many times slower than on a quiet machine the dry run may take here: the load average per core
    (this suite's other worker, other jobs), at least 1 and at most 4. The one-shot stretches its limits by
    it (ONESHOT_TIME_SCALE), so a loaded machine is not taken for a hang, and a hang still meets a limit."""
    return max(1.0, min(4.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def oneshot(tmp_path, timeout=600, **env):
    out = tmp_path / "out"
    values = dict(
        os.environ, OUT=str(out), ONESHOT_WORK=str(tmp_path / "work"), PYTHON=sys.executable, CUDA_VISIBLE_DEVICES=""
    )
    values.update(env)
    done = subprocess.run(["bash", str(ONESHOT)], cwd=ROOT, env=values, capture_output=True, text=True, timeout=timeout)
    summary = (out / "summary.txt").read_text().splitlines() if (out / "summary.txt").exists() else []
    return done, summary, out


def status_of(summary):
    """{check name: status} of the summary lines."""
    return {line.split(" ", 2)[1].rstrip(":"): line.split(" ", 1)[0] for line in summary if " " in line}


@pytest.mark.slow
def test_the_cpu_dry_run_passes_every_check_a_cpu_can_run_and_skips_only_what_needs_cuda(tmp_path):
    scale = load_scale()
    done, summary, out = oneshot(tmp_path, timeout=600 * scale, ONESHOT_DRY_RUN="1", ONESHOT_TIME_SCALE=f"{scale:.2f}")
    assert done.returncode == 0, "\n".join(summary) + done.stdout[-3000:] + done.stderr[-3000:]
    status = status_of(summary)
    assert [s for s in summary if s.startswith("FAIL")] == []
    assert summary[-1].startswith("DONE oneshot: ") and " 0 FAIL" in summary[-1]
    # The plugin is imported and a model built before anything else runs.
    assert next(s for s in summary if s.startswith(("PASS", "FAIL"))).startswith("PASS env_plugin_model")
    must_pass = [
        "env_versions",
        "env_imports",
        "layer_precision[pure_bf16]",
        "layer_bitwise_repeat[fp32,loop]",
        "grouped_mm[E=8,0,1,7]",
        "grouped_mm[E=8,1,7,13]",
        "grouped_mm[E=16,all_empty]",
        "groups_one_rank[padding]",
        "groups_two_ranks[expert_parallel_capacity]",
        "groups_two_ranks[replicas]",
        "groups_two_ranks[pad_only_rank]",
        "groups_two_ranks[lockstep_uneven]",
        "groups_two_ranks[census]",
        "bench_layer[E=64]",
        "fairseq_fp32",
        "fairseq_bf16",
        "fairseq_combined_bf16",
        "fairseq_deterministic",
        "fairseq_two_ranks_gloo",
        "fairseq_two_ranks_gloo_c10d",
        "fairseq_two_ranks_gloo_fully_sharded_bf16_experts_sharded",
        "fairseq_generate",
    ]
    must_pass += [
        f"layer_reference[{r},{m}]"
        for r in ("top", "cosine", "sigmoid")
        for m in ("dropless", "capacity", "padding", "batch_prioritized", "shared_bias")
    ]
    assert {name: status.get(name) for name in must_pass} == {name: "PASS" for name in must_pass}
    # fully_sharded --bf16 trains, or its one-line refusal is the result (refused until FSDP2 maps --bf16).
    fsdp = next(s for s in summary if s.split(" ")[1].rstrip(":") == "fairseq_two_ranks_gloo_fully_sharded_bf16")
    assert fsdp.startswith("PASS") or (fsdp.startswith("INFO") and "refused in one line" in fsdp), fsdp
    assert status.get("groups_two_ranks[collective_time]") == "INFO", "the time in each collective is reported"
    assert all(line.endswith("[card: cpu, dry run]") for line in summary), "every line names the card"
    cuda_only = [s for s in summary if s.startswith("SKIP") and "(cuda)" in s]
    assert {s.split(" ")[1].rstrip(":") for s in cuda_only} == {
        "env_nvidia_smi",
        "layer_host_syncs",
        "fairseq_fp16",
        "fairseq_amp",
    }
    # What comes back from the machine: at most 8 files, no checkpoints, figures for every line.
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and {p.name for p in files} == {"summary.txt", "figures.json", "logs.tar.gz"}
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/fairseq/fp32.log" in names and not [n for n in names if n.endswith(".pt")]
    figures = json.loads((out / "figures.json").read_text())
    assert figures["dry_run"] is True and figures["counts"]["FAIL"] == 0 and figures["finished"] is True
    assert figures["card"] == "cpu, dry run"
    assert len(figures["records"]) == sum(s.startswith(("PASS", "FAIL", "SKIP", "INFO")) for s in summary[2:])


@pytest.mark.slow
def test_once_the_deadline_has_passed_every_check_says_skip_and_the_files_still_come_back(tmp_path):
    done, summary, out = oneshot(tmp_path, ONESHOT_DRY_RUN="1", ONESHOT_DEADLINE_S="1")
    assert done.returncode == 0, done.stderr
    skipped = [s.split(" ")[1].rstrip(":") for s in summary if s.startswith("SKIP") and "(deadline)" in s]
    assert skipped == ["env", "layer", "grouped", "groups", "bench", "fairseq"]
    assert summary[-1].startswith("DONE oneshot: 0 PASS, 0 FAIL, 6 SKIP")
    assert {p.name for p in out.iterdir()} == {"summary.txt", "figures.json", "logs.tar.gz"}
    assert all(line.endswith(" [card: cpu, dry run]") for line in summary), "every line names the card"


@pytest.mark.slow
def test_without_cuda_a_gpu_run_reports_the_environment_and_skips_gpu_sized_checks(
    tmp_path,
):
    done, summary, _ = oneshot(tmp_path, ONESHOT_WHEELS=str(tmp_path / "no-wheels"), ONESHOT_ONLY="env,layer,fairseq")
    status = status_of(summary)
    assert done.returncode == 1  # env_versions: no CUDA device
    assert status["env_plugin_model"] == "PASS" and status["env_versions"] == "FAIL"
    assert [s.split(":")[0] for s in summary if "(cuda) torch" in s] == ["SKIP layer", "SKIP fairseq"]


def test_without_python_the_summary_says_so_instead_of_no_cuda_device(tmp_path):
    done, summary, _ = oneshot(tmp_path, PYTHON="python3-not-installed-here")
    assert done.returncode == 2
    assert summary[-1].startswith("FAIL environment: no 'python3-not-installed-here' on PATH")


def test_a_python_without_torch_is_named_in_the_summary_with_its_import_error(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(
        "#!/bin/sh\nif [ \"$1\" = -V ]; then echo 'Python 3.12.3'; exit 0; fi\n"
        "echo \"ModuleNotFoundError: No module named 'torch'\" >&2; exit 1\n"
    )
    fake.chmod(0o755)
    done, summary, _ = oneshot(tmp_path, PYTHON=str(fake))
    assert done.returncode == 2
    assert summary[-1].startswith(
        f"FAIL environment: Python 3.12.3 at {fake} cannot import torch: ModuleNotFoundError: No module named 'torch' "
        f"[card: "
    )


def test_the_oneshot_parses_and_lists_its_knobs():
    assert subprocess.run(["bash", "-n", str(ONESHOT)]).returncode == 0
    usage = subprocess.run(["bash", str(ONESHOT), "--help"], capture_output=True, text=True)
    assert usage.returncode == 0
    assert all(knob in usage.stdout for knob in ("ONESHOT_DRY_RUN", "ONESHOT_DEADLINE_S", "OUT", "SKIP (cuda)"))


def processes_with(marker: str):
    """Ids of the live processes whose environment holds ``marker`` (this test's scratch folder)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.mark.slow
def test_a_oneshot_stopped_mid_check_kills_the_check_and_still_writes_its_figures(tmp_path):
    """The lent machine's own limit ends the one-shot with SIGTERM: the running check is killed, and
    figures.json (written after every check) and the logs still come back, with what had finished."""
    out, work = tmp_path / "out", tmp_path / "work"
    values = dict(os.environ, OUT=str(out), ONESHOT_WORK=str(work), PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    values.update(ONESHOT_DRY_RUN="1", ONESHOT_ONLY="env,layer", ONESHOT_TIME_SCALE=f"{load_scale():.2f}")
    oneshot = subprocess.Popen(["bash", str(ONESHOT)], cwd=ROOT, env=values, start_new_session=True)
    try:
        deadline = time.time() + 300 * load_scale()
        while not (work / "logs" / "layer.log").exists() and oneshot.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert oneshot.poll() is None, "the one-shot ended before its layer check started"
        assert (out / "figures.json").exists(), "figures.json is written after the env check, not only at the end"
        os.killpg(oneshot.pid, signal.SIGTERM)
        oneshot.wait(timeout=60)  # the shell goes at once; oneshot.py stops its check, then writes
        stop = time.time() + 60
        while any(b"oneshot.py" in cmdline(pid) for pid in processes_with(str(work))) and time.time() < stop:
            time.sleep(0.2)
    finally:
        if oneshot.poll() is None:
            os.killpg(oneshot.pid, signal.SIGKILL)
    # The moment oneshot.py is gone, so is the check it was running (a check takes far longer than this).
    assert [cmdline(pid) for pid in processes_with(str(work))] == [], "a check outlived the one-shot"
    figures = json.loads((out / "figures.json").read_text())
    assert figures["finished"] is True and any(r["check"] == "env_plugin_model" for r in figures["records"])
    assert (out / "logs.tar.gz").exists() and (out / "summary.txt").read_text().splitlines()[-1].startswith("DONE")


def test_only_the_plugins_one_line_refusal_is_read_as_a_two_rank_runs_refusal():
    # The plugin's refusals print "<prog>: error: rank r of W: ..." (fairseq_integration/cli.py); a ValueError
    # naming a flag is a crash like any other, and argparse's own error names no rank. A log that trained has
    # no refusal. oneshot_ranks is imported in a child, as the one-shot imports it (benchmarks/device on
    # sys.path), so no benchmark module enters this process.
    logs = {
        "plugin": "x\nfairseq-train: error: rank 1 of 2: --moe-fully-sharded-experts sharded needs a newer torch\n",
        "value_error": "Traceback\nValueError: --bf16 is refused under fully_sharded\n",
        "argparse": "train.py: error: argument --arch: invalid choice: 'x'\n",
        "trained": "| train_inner | epoch 001\nfairseq-train: error: rank 0 of 2: late\n",
        "crash": "Traceback\nRuntimeError: CUDA error\n",
    }
    child = (
        "import json, sys; sys.path[:0] = ['benchmarks/device', 'recipes']; from oneshot_ranks import refusal; "
        "print(json.dumps({k: refusal(v) for k, v in json.loads(sys.stdin.read()).items()}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", child], cwd=ROOT, input=json.dumps(logs), capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout) == {
        "plugin": "--moe-fully-sharded-experts sharded needs a newer torch",
        "value_error": None,
        "argparse": None,
        "trained": None,
        "crash": None,
    }


# The dry run's planted faults (benchmarks/device/oneshot_plant.py): a gradient twice too large in the c10d
# two-rank run and in the bf16 run, and a ValueError naming a flag that stops the fully_sharded two-rank run.
PLANTED = "two_ranks_gloo_c10d=wrong_scale,two_ranks_gloo_fully_sharded_bf16=crash,bf16=wrong_scale"


@pytest.mark.slow
def test_the_dry_runs_verdicts_fail_on_a_planted_wrong_scale_gradient_and_a_planted_crash(tmp_path):
    scale = load_scale()
    env = dict(ONESHOT_DRY_RUN="1", ONESHOT_ONLY="fairseq", ONESHOT_PLANT=PLANTED, ONESHOT_TIME_SCALE=f"{scale:.2f}")
    done, summary, _ = oneshot(tmp_path, timeout=400 * scale, **env)
    assert done.returncode == 1, "\n".join(summary) + done.stderr[-3000:]
    status = status_of(summary)
    line = {s.split(" ")[1].rstrip(":"): s for s in summary if " " in s}
    # Adam trains on with a doubled gradient: the loss fell as far as legacy_ddp's, which passed the old verdict.
    c10d = line["fairseq_two_ranks_gloo_c10d"]
    assert status["fairseq_two_ranks_gloo_c10d"] == "FAIL" and "gradient norm within 10" in c10d, c10d
    first, last = map(float, re.search(r"train ([\d.]+) -> ([\d.]+)", c10d).groups())
    assert last < 0.95 * first, c10d
    assert status["fairseq_bf16"] == "FAIL" and "gradient norm within 10" in line["fairseq_bf16"], line["fairseq_bf16"]
    # A ValueError naming a flag is a crash, not the plugin's refusal.
    assert status["fairseq_two_ranks_gloo_fully_sharded_bf16"] == "FAIL", line[
        "fairseq_two_ranks_gloo_fully_sharded_bf16"
    ]
    # A planted dry run starts the planted runs and their references (which pass) only.
    assert status["fairseq_two_ranks_gloo"] == status["fairseq_fp32"] == "PASS", summary
    assert "fairseq_two_ranks_gloo_fully_sharded_bf16_experts_sharded" not in status, summary
