"""The suite's single-process fairseq runs are forks of a process that has imported fairseq
(tests/support/warm_fairseq.py). A forked run must be what ``python -m fairseq_cli.<tool>`` in a fresh
interpreter is: the same exit status, the same last line, the same training numbers, with the interpreter's
exit rules, stdin, working directory and timeout."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

import warm_fairseq
from fairseq_helpers import USER_DIR, fairseq_env, json_logs, run_fairseq, train_args

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
    launcher = warm_fairseq.launcher(fairseq_env())
    if launcher is None:
        pytest.skip("MOE_TEST_COLD_CLI=1: every run is a fresh interpreter already")
    return launcher


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


def numbers(records):
    """What training computed, without what the clock measured."""
    return [{k: v for k, v in r.items() if k not in ("wps", "ups", "wall", "train_wall", "gb_free")} for r in records]
