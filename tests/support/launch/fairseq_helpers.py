"""Tiny deterministic corpora and a runner for fairseq's command-line tools, for the fairseq tests.

Nothing is downloaded: the corpora are generated from a seeded RNG and are learnable in a few dozen
updates, so "the loss falls" is a real check and not noise.
"""

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

import fairseq_moe_ext
from support.launch import warm_fairseq
from support.launch.paths import REPO_ROOT

sys.path.append(str(REPO_ROOT / "recipes"))  # the modules tests share with recipes and benchmarks
import toy_pair  # noqa: E402
from fairseq_logs import json_records  # noqa: E402
from toy_pair import SPLITS, VOCAB, source_sentence, translate  # noqa: E402, F401

USER_DIR = fairseq_moe_ext.PACKAGE_DIR
CONFIG_DIR = os.path.join(USER_DIR, "config")


def write_parallel_corpus(raw: Path, seed: int = 0) -> Path:
    """The toy pair of recipes/toy_pair.py, in the split sizes of ``SPLITS`` (which a caller may change)."""
    return toy_pair.write_parallel_corpus(raw, seed, SPLITS)


def write_lm_corpus(raw: Path, seed: int = 0) -> Path:
    """Arithmetic progressions modulo VOCAB: after two tokens every next token is predictable."""
    raw.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, lines in SPLITS.items():
        text = []
        for _ in range(lines):
            start, step = rng.randrange(VOCAB), rng.choice([1, 2, 3])
            text.append(" ".join(f"w{(start + step * i) % VOCAB}" for i in range(rng.randint(4, 16))))
        (raw / f"{split}.txt").write_text("\n".join(text) + "\n")
    return raw


def preprocess_parallel(raw: Path, dest: Path) -> Path:
    return preprocess_in_process(raw, dest)


def preprocess_lm(raw: Path, dest: Path) -> Path:
    return preprocess_in_process(raw, dest, language_model=True)


def preprocess_in_process(raw: Path, dest: Path, language_model: bool = False) -> Path:
    """fairseq-preprocess's own main (recipes/toy_pair.binarize) on
    a corpus of write_parallel_corpus or write_lm_corpus, run in this process: pytest has imported
    fairseq already, a fresh interpreter would spend seconds importing it again. Tests that only
    read the result use the session fixtures ``parallel_data`` / ``lm_data`` of conftest.py."""
    return toy_pair.binarize(raw, dest, SPLITS, language_model)


LEAN_IMPORTS = str(REPO_ROOT / "recipes" / "lib" / "lean_imports")  # shared with the GPU one-shot's dry run


def fairseq_env() -> Dict[str, str]:
    env = dict(os.environ)
    # Two cores: one intra-op thread per run keeps runs from fighting each other and pytest.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # scikit-learn and scipy.stats imported on first use only (see recipes/lib/lean_imports/sitecustomize.py); the package
    # from this checkout, whichever checkout a shared venv's editable install points at.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (LEAN_IMPORTS, str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def fresh_interpreter(command, env, timeout, input=None, cwd=None, combined=True) -> subprocess.CompletedProcess:
    """``command`` as a subprocess (text; stderr in stdout when ``combined``); exit status None past ``timeout``
    seconds, with what it wrote by then."""
    stderr = subprocess.STDOUT if combined else subprocess.PIPE
    try:
        return subprocess.run(
            command, input=input, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=timeout, env=env, cwd=cwd
        )
    except subprocess.TimeoutExpired as timed_out:
        output = timed_out.stdout or ""
        return subprocess.CompletedProcess(
            command, None, output.decode(errors="replace") if isinstance(output, bytes) else output, ""
        )


def run_fairseq(
    tool: str,
    *args: str,
    timeout: float = 150,
    input: Optional[str] = None,
    expect_failure: bool = False,
    cwd: Optional[Path] = None,
    expect_status: Optional[int] = None,
    probe: Optional[Path] = None,
) -> str:
    """Run ``fairseq_cli.<tool>`` with ``args`` as ``python -m`` would and return its combined output: forked
    from a process that has imported fairseq (warm_fairseq.py; ``MOE_TEST_COLD_CLI=1``: a fresh interpreter).
    With ``probe``, ``python PROBE tool args`` (a probe that runs the tool itself, having changed something first).

    The test fails with the output's tail if the exit status is not the expected one (zero, or
    non-zero when ``expect_failure``; ``expect_status`` when given) or the run outlives ``timeout`` seconds.
    """
    args = [*map(str, args)]
    target, argv = ({"module": f"fairseq_cli.{tool}"}, args) if probe is None else ({"path": str(probe)}, [tool, *args])
    command = [sys.executable, *(["-m", target["module"]] if probe is None else [target["path"]]), *argv]
    env = fairseq_env()
    warm = warm_fairseq.launcher(env)
    if warm is not None:  # a fork of a process that has imported fairseq: see warm_fairseq.py
        done = subprocess.CompletedProcess(command, *warm.launch(target, argv, [{"env": env}], cwd, input, timeout))
    else:
        done = fresh_interpreter(command, env, timeout, input=input, cwd=cwd)
    if done.returncode is None:
        pytest.fail(f"fairseq-{tool} ran past {timeout}s\n{tail(done.stdout)}", pytrace=False)
    failed = done.returncode != 0
    if failed != expect_failure or expect_status not in (None, done.returncode):
        expected = "to fail" if expect_failure else "to succeed"
        pytest.fail(
            f"expected fairseq-{tool} {expected}, exit status {done.returncode}:\n"
            f"$ {' '.join(command)}\n{tail(done.stdout)}",
            pytrace=False,
        )
    return done.stdout


CHECKPOINT_TOOL = "fairseq_moe_ext.checkpoint"
FAIRSEQ_MOE = str(Path(sys.executable).parent / "fairseq-moe")  # the console script setup.py installs


def run_checkpoint_tool(
    *args, check: bool = False, combined: bool = False, timeout: float = 300, program: str = CHECKPOINT_TOOL
):
    """``python -m fairseq_moe_ext.checkpoint args`` as a ``subprocess.CompletedProcess`` (text; stdout and stderr
    apart, or together in stdout when ``combined``), forked from the warm server (warm_fairseq.py; its import of torch
    saved; ``MOE_TEST_COLD_CLI=1``: a fresh interpreter). ``check``: the test fails unless it exits 0. ``program``:
    another of fairseq-moe's spellings, a module (``python -m``) or the installed script (``FAIRSEQ_MOE``)."""
    script = os.sep in program
    command = [program, *map(str, args)] if script else [sys.executable, "-m", program, *map(str, args)]
    env = fairseq_env()
    warm = warm_fairseq.launcher(env)
    if warm is None:
        done = fresh_interpreter(command, env, timeout, combined=combined)
    elif combined:
        done = subprocess.CompletedProcess(command, *warm.run(program, args, env, None, None, timeout))
    else:
        done = subprocess.CompletedProcess(command, *warm.run_apart(program, args, env, None, timeout))
    if done.returncode is None:
        pytest.fail(f"{' '.join(command)} ran past {timeout}s\n{tail(done.stdout)}", pytrace=False)
    if check and done.returncode != 0:
        pytest.fail(
            f"exit {done.returncode}: {' '.join(command)}\n{tail(done.stdout)}\n{tail(done.stderr or '')}",
            pytrace=False,
        )
    return done


def torchrun_command(workers, port, program, args, log_dir=None, redirects=1) -> List[str]:
    """The real launcher's command line: ``torchrun --nproc_per_node workers [--log-dir --redirects]`` on ``port``."""
    redirect = ["--log-dir", str(log_dir), "--redirects", str(redirects)] if log_dir else []
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(workers), *redirect]
    return command + ["--master_port", str(port), str(program), *map(str, args)]


def torchrun(
    workers, program, args, timeout=240, expect_failure=False, log_dir=None, world_size_flag=True, redirects=1
):
    """Run ``program args`` on ``workers`` CPU workers under torchrun (gloo) and return the output.

    ``--distributed-world-size workers`` is appended unless ``world_size_flag`` is False (fairseq
    otherwise runs each worker as a job of its own). ``log_dir``: each worker's stdout goes to its
    own file there (lines of concurrent workers would otherwise interleave mid-line in one pipe);
    ``redirects=3`` sends their stderr (where fairseq's CLIs log) to files there too. The workers are
    forks of the warm server with torchrun's variables (warm_fairseq.py; ``MOE_TEST_COLD_CLI=1``: a real
    torchrun and fresh interpreters).
    """
    from support.launch.dist_utils import free_port

    args = [*map(str, args)]
    if workers > 1 and world_size_flag:
        args += ["--distributed-world-size", str(workers)]
    port = free_port()
    command = torchrun_command(workers, port, program, args, log_dir, redirects)
    env = fairseq_env()
    warm = warm_fairseq.launcher(env)
    if warm is not None:  # the launcher's job done by the warm server: see warm_fairseq.py
        done = subprocess.CompletedProcess(
            command, *warm.torchrun(program, args, env, workers, port, timeout, log_dir, redirects)
        )
    else:
        done = fresh_interpreter(command, env, timeout)
    if done.returncode is None:
        pytest.fail(f"torchrun {program} ran past {timeout}s\n{tail(done.stdout, 60)}", pytrace=False)
    if (done.returncode != 0) != expect_failure:
        pytest.fail(f"exit {done.returncode}: {' '.join(command)}\n{tail(done.stdout, 60)}", pytrace=False)
    return done.stdout


def tail(output: str, lines: int = 40) -> str:
    return "\n".join(output.splitlines()[-lines:])


def translation_flags(data, arch: str) -> List[str]:
    """How fairseq-train's command line starts for a model of this plugin on the src-tgt pair of ``data``
    (dictionaries are enough for a model built in this process)."""
    # fmt: off
    return [str(data), "--user-dir", USER_DIR, "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
            "--arch", arch]
    # fmt: on


def train_args(data: Path, save_dir: Path, *extra: str, max_update: int = 40) -> List[str]:
    """The flags every training run shares: CPU, json logs every few updates, no epoch checkpoints."""
    return [
        str(data),
        "--user-dir",
        USER_DIR,
        "--cpu",
        "--seed",
        "1",
        "--optimizer",
        "adam",
        "--lr",
        "3e-3",
        "--max-update",
        str(max_update),
        "--save-dir",
        str(save_dir),
        "--no-epoch-checkpoints",
        "--num-workers",
        "0",
        "--log-format",
        "json",
        "--log-interval",
        "5",
        *extra,
    ]


def json_logs(output: str, tag: str = "train_inner") -> List[dict]:
    """The ``--log-format json`` records of one kind (``train_inner``, ``train`` or ``valid``)."""
    return json_records(output, tag)


def logged_losses(output: str) -> List[float]:
    return [float(r["loss"]) for r in json_logs(output)]


def assert_loss_falls(output: str, by: float = 0.85) -> None:
    """The last logged training loss is at most ``by`` times the first: the model learns something."""
    losses = logged_losses(output)
    assert len(losses) >= 3, f"too few train_inner records to judge learning:\n{tail(output)}"
    assert losses[-1] < by * losses[0], f"training loss did not fall: {losses}"


def load_rank_probes(probe_dir: Path, workers: int) -> List[dict]:
    """What tests/support/probes/fairseq_rank_probe.py recorded in each worker after training."""
    import torch

    return [torch.load(Path(probe_dir) / f"rank{r}.pt") for r in range(workers)]


def assert_shared_identical_experts_distinct_norms_equal(ranks: List[dict], updates: int) -> None:
    """After multi-worker training: every shared tensor bitwise equal on every worker, every expert
    tensor different, and the logged gradient norms identical on every worker, one per update."""
    import torch

    experts = set(ranks[0]["expert_keys"])
    assert experts
    for other in ranks[1:]:
        for key, value in ranks[0]["model"].items():
            if key in experts:
                assert not torch.equal(value, other["model"][key]), f"expert {key} is identical on two ranks"
            else:
                assert torch.equal(value, other["model"][key]), f"shared {key} differs across ranks"
        assert other["grad_norms"] == ranks[0]["grad_norms"]
    assert len(ranks[0]["grad_norms"]) == updates
