"""The suite's fairseq runs, single-process and under torchrun, are forks of a process that has imported
fairseq (tests/support/launch/warm_fairseq.py). A forked run must be what ``python -m fairseq_cli.<tool>`` in a fresh
interpreter, or a real torchrun launch, is: the same exit status, the same last line, the same training numbers,
with the interpreter's exit rules, stdin, working directory and timeout."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.launch import warm_fairseq
from support.launch.dist_utils import free_port
from support.launch.fairseq_helpers import (
    USER_DIR,
    fairseq_env,
    fresh_interpreter,
    json_logs,
    run_fairseq,
    torchrun,
    torchrun_command,
    train_args,
)

# A module run as ``python -m NAME`` (from the working directory), and what its run must give: (exit status,
# the output's last line, or a substring of the output where its last line is a traceback's).
# fmt: off
EXIT_RULES = {
    "returns": ("print('ran', __name__)", 0, "ran __main__"),
    "exits-with-a-number": ("import sys; print('x'); sys.exit(3)", 3, "x"),
    "exits-with-a-message": ("import sys; sys.exit('refused: use --fix')", 1, "refused: use --fix"),
    "raises": ("raise ValueError('no such flag')", 1, "ValueError: no such flag"),
    "reads-stdin": ("import sys; print(sys.stdin.read().upper().strip())", 0, "FROM STDIN"),
    "atexit-runs": ("import atexit; atexit.register(lambda: print('at exit'))", 0, "at exit"),
    "argv": ("import sys; print(sys.argv[1:])", 0, "['--a', 'b']"),
    "cwd-first-on-path": ("import sys, os; print(sys.path[0] == os.getcwd())", 0, "True"),
}
# fmt: on


def warm_launcher():
    if os.environ.get("MOE_TEST_COLD_CLI") == "1":
        pytest.skip("MOE_TEST_COLD_CLI=1: every run is a fresh interpreter already")
    launcher = warm_fairseq.launcher(fairseq_env())
    # None here: the start-up variables of fairseq_env() changed since the server started, and every
    # warm run of this process silently went cold.
    assert launcher is not None, (
        f"the warm server does not serve fairseq_env() any more: {warm_fairseq.unserved_variables(fairseq_env())} changed"
    )
    return launcher


@pytest.mark.slow
@pytest.mark.parametrize("case", list(EXIT_RULES))
def test_a_forked_run_follows_the_interpreters_exit_rules_stdin_argv_and_path(case, tmp_path):
    source, status, shown = EXIT_RULES[case]
    (tmp_path / "probe_module.py").write_text(source + "\n")
    launcher = warm_launcher()
    returncode, output = launcher.run("probe_module", ["--a", "b"], fairseq_env(), tmp_path, "from stdin\n", 60)
    fresh = subprocess.run(
        [sys.executable, "-m", "probe_module", "--a", "b"],
        input="from stdin\n",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=fairseq_env(),
    )
    assert returncode == fresh.returncode == status
    assert shown in output and shown in fresh.stdout + fresh.stderr


@pytest.mark.slow
def test_a_forked_run_past_its_timeout_is_killed_with_its_children(tmp_path):
    (tmp_path / "sleeper.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    returncode, output = warm_launcher().run("sleeper", [], fairseq_env(), tmp_path, None, 3)
    assert returncode is None
    status = Path(f"/proc/{int(output.split()[0])}/status")
    time.sleep(0.5)
    assert not status.exists() or "State:\tZ" in status.read_text(), "the run's own child outlived the timeout"


@pytest.mark.slow
def test_a_forked_fairseq_train_refuses_and_trains_as_a_fresh_interpreter_does(parallel_data, tmp_path):
    warm_launcher()
    refused = ["--arch", "moe_transformer_tiny", "--criterion", "moe_cross_entropy", "--moe-top-k", "0"]
    trained = [*train_args(parallel_data, tmp_path / "ck", max_update=4), "--log-interval", "1", "--no-save"]
    trained += ["--arch", "moe_transformer_tiny", "--criterion", "moe_cross_entropy", "--max-tokens", "500"]
    for args, fails in (([str(parallel_data), "--user-dir", USER_DIR, "--cpu", *refused], True), (trained, False)):
        warm = run_fairseq("train", *args, expect_failure=fails)
        cold = subprocess.run(
            [sys.executable, "-m", "fairseq_cli.train", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=fairseq_env(),
        )
        assert (cold.returncode != 0) == fails
        if fails:
            assert warm.strip().splitlines()[-1] == cold.stdout.strip().splitlines()[-1]
        else:
            assert json_logs(warm) and numbers(json_logs(warm)) == numbers(json_logs(cold.stdout))
            assert "| INFO | fairseq_cli.train |" in warm  # fairseq's own log format, as in a fresh interpreter


@pytest.mark.slow
def test_an_emulated_two_worker_torchrun_trains_and_refuses_as_a_real_torchrun_does(parallel_data, tmp_path):
    """The same 2-worker fairseq-train through the warm server and through ``python -m torch.distributed.run``:
    the same logged numbers (the workers met over gloo and their ranks and world size are torchrun's), and a
    refused run the same status and last error line, rank prefix included."""
    launcher = warm_launcher()
    program = Path(sys.executable).parent / "fairseq-train"
    moe = ["--arch", "moe_transformer_tiny", "--criterion", "moe_cross_entropy", "--max-tokens", "300"]
    trained = [*train_args(parallel_data, tmp_path / "ck", max_update=3), "--log-interval", "1", "--no-save", *moe]
    refused = [*train_args(parallel_data, tmp_path / "no", max_update=3), *moe, "--moe-expert-parallel-size", "3"]
    for args, fails in ((trained, False), (refused, True)):
        args = [*args, "--ddp-backend", "legacy_ddp", "--distributed-world-size", "2"]
        warm_status, warm = launcher.torchrun(program, args, fairseq_env(), 2, free_port(), 240)
        cold = fresh_interpreter(torchrun_command(2, free_port(), program, args), fairseq_env(), 240)
        assert (warm_status, cold.returncode) == ((1, 1) if fails else (0, 0)), warm[-3000:]
        if fails:
            rank_0 = "fairseq-train: error: rank 0 of 2: "  # a refusal: one line per worker, naming its rank
            last = lambda text: [line for line in text.splitlines() if line.startswith(rank_0)][-1]  # noqa: E731
            assert last(warm) == last(cold.stdout) and "--moe-expert-parallel-size" in last(warm)
            assert "[warm launcher] rank " in warm.splitlines()[-1]
        else:
            assert json_logs(warm) and numbers(json_logs(warm)) == numbers(json_logs(cold.stdout))
            assert "distributed_world_size" not in warm or "'distributed_world_size': 2" in warm


@pytest.mark.slow
def test_a_worker_that_fails_stops_its_peers_and_fails_the_emulated_launch(tmp_path):
    """What torchrun's agent does when a worker exits non-zero: the others are stopped, the launch exits 1."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys, time\n"
        "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'local', os.environ['LOCAL_RANK'])\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit(7)\n"
        "time.sleep(600)\n"
    )
    started = time.monotonic()
    status, output = warm_launcher().torchrun(script, [], fairseq_env(), 3, free_port(), 120, tmp_path / "logs", 1)
    assert status == 1 and time.monotonic() - started < warm_fairseq.STOP_GRACE / 2  # SIGTERM, not the SIGKILL after
    assert "[warm launcher] rank 1 exited with status 7 first; the others were stopped" in output
    for rank in range(3):
        logged = (tmp_path / "logs" / "none_warm" / "attempt_0" / str(rank) / "stdout.log").read_text()
        assert logged == f"rank {rank} of 3 local {rank}\n"
    assert torchrun(2, script, [], expect_failure=True, world_size_flag=False, timeout=120)


# fairseq-train configures logging before it imports fairseq, fairseq-generate after: whose configuration wins
# decides whether a worker's log goes to its stdout file or to the launcher's output.
LOGGING_ORDERS = {
    "configured-first": "logging.basicConfig(stream=sys.stdout, level=logging.INFO)\nimport fairseq\n",
    "fairseq-imported-first": "import fairseq\nlogging.basicConfig(stream=sys.stdout, level=logging.INFO)\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("order", list(LOGGING_ORDERS))
def test_a_forked_worker_logs_to_the_stream_a_fresh_interpreter_logs_to(order, tmp_path):
    script = tmp_path / "logs.py"
    script.write_text("import logging, sys\n" + LOGGING_ORDERS[order] + "logging.getLogger('probe').info('HERE')\n")
    status, output = warm_launcher().torchrun(script, [], fairseq_env(), 1, free_port(), 60, tmp_path / "logs", 1)
    stdout = next((tmp_path / "logs").glob("**/0/stdout.log")).read_text()
    fresh = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=fairseq_env())
    assert status == fresh.returncode == 0, output
    assert ("HERE" in stdout, "HERE" in output) == ("HERE" in fresh.stdout, "HERE" in fresh.stderr)
    assert ("HERE" in stdout) == (order == "configured-first")


def numbers(records):
    """What training computed, without what the clock measured."""
    return [{k: v for k, v in r.items() if k not in ("wps", "ups", "wall", "train_wall", "gb_free")} for r in records]


# What the suite does in its own process (imports, FSDP2), in a fresh interpreter: the start-up variables of the
# runs it starts afterwards must be those of before, or the warm server started first serves none of them.
SUITE_ACTIONS = """
import os, sys
from support.launch import warm_fairseq
from support.launch.fairseq_helpers import fairseq_env
before = fairseq_env()
import fairseq, fairseq_cli.train, fairseq_moe_ext.fairseq_integration, matplotlib.pyplot, sacrebleu
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
model = torch.nn.Linear(4, 4)
fully_shard(model)
model(torch.randn(2, 4)).sum().backward()
dist.destroy_process_group()
print("changed:", warm_fairseq.startup_difference(before, fairseq_env()))
"""


@pytest.mark.slow
def test_the_suites_in_process_imports_and_fsdp2_leave_the_runs_start_up_variables_alone(tmp_path):
    # Seen in CI: FSDP2 imports torch._dynamo, which sets TORCHINDUCTOR_CACHE_DIR, and every warm run after
    # the first in-process FSDP2 test went cold (scikit-learn's two KMP_ before that).
    tests = Path(warm_fairseq.__file__).parents[2]  # the folder holding the package support/
    env = dict(fairseq_env(), PYTHONPATH=os.pathsep.join([str(tests), fairseq_env()["PYTHONPATH"]]))
    for name in warm_fairseq.SET_BY_IMPORTS:
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", SUITE_ACTIONS, str(free_port())], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "changed: []" in done.stdout, done.stdout


def test_a_server_ignores_what_libraries_set_when_imported_and_no_other_start_up_variable():
    env = dict(fairseq_env())
    for name in warm_fairseq.SET_BY_IMPORTS:
        env.pop(name, None)
    difference = warm_fairseq.startup_difference
    assert difference(env, dict(env, KMP_DUPLICATE_LIB_OK="True", TORCHINDUCTOR_CACHE_DIR="/x")) == []
    assert difference(env, dict(env, OMP_NUM_THREADS="2", PYTHONHASHSEED="1")) == [
        "OMP_NUM_THREADS",
        "PYTHONHASHSEED",
    ]
