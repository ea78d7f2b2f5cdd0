"""fairseq's command-line tools, and torchrun launches of them, started from a process that has already
imported fairseq, for the suite: the suite's side of warm_server.py.

``python -m fairseq_cli.train ARGS`` spends about 2.5 s of CPU importing torch and fairseq before it reads its
arguments, and the suite starts over a hundred such runs (most of the bad-input catalogue fails while parsing); a
2-worker torchrun launch pays it three times (the launcher and each worker). Each pytest process starts one server
(warm_server.py), which imports fairseq once and forks a child per process a run needs; a child becomes the run
the way a fresh interpreter would (see warm_server.py).

A request of W processes stands for ``torchrun --nproc_per_node W``: each child gets the variables torchrun's agent
sets (``torchrun_env``, with no agent store, so rank 0 hosts the rendezvous store), per-rank log files
(``--log-dir``/``--redirects``) are laid out as torchrun lays them out, and a failed worker stops the others.
torchrun itself (its rendezvous, restarts, signal forwarding) is exercised by tests/cli/test_fault_injection.py,
tests/cli/test_warm_cli.py and the recipes, which start it. One request at a time per caller, several callers at
once (each waits for its own status file). ``MOE_TEST_COLD_CLI=1`` turns the server off: every run is a fresh
interpreter (or a real torchrun) again.
"""

import atexit
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

from support.launch.warm_server import POLL, STOP_GRACE  # noqa: F401  (STOP_GRACE: for the tests)

# Variables read when the interpreter, torch or its thread pools start: a request whose values differ from the
# server's cannot be served by a fork of it and runs in a fresh interpreter instead.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS", "TORCH", "CUDA", "LD_")
# Except these, which a library puts in os.environ itself when imported and reads only after that: scikit-learn
# (fairseq imports it) the two KMP_, torch._dynamo (FSDP2 imports it) the inductor cache. A pytest process that
# imports them after its server started must still be served (else its later runs silently go cold), and a fork
# of the server that imports the same libraries sets the same values. tests/cli/test_warm_cli.py checks that the
# suite's imports set no other start-up variable.
SET_BY_IMPORTS = frozenset({"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "TORCHINDUCTOR_CACHE_DIR"})


def startup_variables(env: Dict[str, str]) -> Dict[str, str]:
    """The variables of ``env`` a fork of the server must share with the server's own start."""
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and k not in SET_BY_IMPORTS}


def startup_difference(one: Dict[str, str], other: Dict[str, str]) -> List[str]:
    """The start-up variables two environments do not share, by name."""
    one, other = startup_variables(one), startup_variables(other)
    return sorted(k for k in one.keys() | other.keys() if one.get(k) != other.get(k))


def torchrun_env(env: Dict[str, str], workers: int, rank: int, port: int) -> Dict[str, str]:
    """``env`` with what torchrun's agent gives worker ``rank`` of ``workers`` on one node (torch 2.x's
    local_elastic_agent), without the agent's store: rank 0 hosts the rendezvous store on ``port``."""
    return dict(
        env,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        LOCAL_WORLD_SIZE=str(workers),
        WORLD_SIZE=str(workers),
        GROUP_WORLD_SIZE="1",
        ROLE_WORLD_SIZE=str(workers),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID="none",
        TORCHELASTIC_USE_AGENT_STORE="False",
        TORCH_NCCL_ASYNC_ERROR_HANDLING=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    )


def target_of(program: str) -> dict:
    """What the server runs as ``__main__``: a script by its path, else a module (``python -m``)."""
    return {"path": program} if os.sep in program else {"module": program}


class WarmLauncher:
    """The suite's side: one server per pytest process, started on first use, stopped at exit."""

    def __init__(self, env: Dict[str, str]):
        self.env = dict(env)
        here = os.path.dirname(os.path.abspath(__file__))
        command = [sys.executable, os.path.join(here, "warm_server.py")]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, cwd=here)
        if self.process.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the warm fairseq server did not start (exit {self.process.wait()})")
        self.work = tempfile.mkdtemp(prefix="warm-fairseq-")
        self.lock = threading.Lock()
        self.numbers = itertools.count()
        atexit.register(self.close)

    def serves(self, env: Dict[str, str]) -> bool:
        return self.process.poll() is None and not startup_difference(self.env, env)

    def run(self, program, args, env, cwd, stdin_text, timeout) -> Tuple[Optional[int], str]:
        """``python -m program args``, or ``program args`` where ``program`` is a script's path (an installed console
        script): (exit status, or None after ``timeout`` seconds; stdout and stderr together)."""
        return self.launch(target_of(program), args, [{"env": env}], cwd, stdin_text, timeout)

    def run_apart(self, program, args, env, cwd, timeout) -> Tuple[Optional[int], str, str]:
        """As ``run``: (exit status or None; stdout; stderr)."""
        stderr_path = os.path.join(self.work, f"{next(self.numbers)}.err")
        try:
            status, stdout = self.launch(
                target_of(program), args, [{"env": env, "stderr": stderr_path}], cwd, None, timeout
            )
            with open(stderr_path, errors="replace") as f:
                return status, stdout, f.read()
        finally:
            if os.path.exists(stderr_path):
                os.remove(stderr_path)

    def torchrun(self, path, args, env, workers, port, timeout, log_dir=None, redirects=0) -> Tuple[Optional[int], str]:
        """``torchrun --nproc_per_node workers [--log-dir log_dir --redirects redirects] path args`` on ``port``:
        (exit status, or None after ``timeout`` seconds; what the workers did not send to their log files)."""
        ranks = []
        for rank in range(workers):
            files = {"env": torchrun_env(env, workers, rank, port)}
            if log_dir is not None and redirects:
                own = os.path.join(str(log_dir), "none_warm", "attempt_0", str(rank))
                os.makedirs(own, exist_ok=True)
                for bit, stream in ((1, "stdout"), (2, "stderr")):
                    if redirects & bit:
                        files[stream] = os.path.join(own, f"{stream}.log")
            ranks.append(files)
        return self.launch({"path": str(path)}, args, ranks, os.getcwd(), None, timeout)

    def launch(self, target, args, ranks, cwd, stdin_text, timeout) -> Tuple[Optional[int], str]:
        number = next(self.numbers)
        output = os.path.join(self.work, f"{number}.out")
        stdin_path = None
        if stdin_text is not None:
            stdin_path = os.path.join(self.work, f"{number}.in")
            with open(stdin_path, "w") as f:
                f.write(stdin_text)
        ranks = [dict({"stdout": output, "stderr": output}, **files) for files in ranks]
        request = dict(target=target, args=[str(a) for a in args], ranks=ranks, cwd=str(cwd or os.getcwd()))
        request.update(stdin=stdin_path, output=output, timeout=timeout)
        with self.lock:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
        status_path = output + ".status"
        while not os.path.exists(status_path):
            if self.process.poll() is not None:
                raise RuntimeError(f"the warm fairseq server died (exit {self.process.returncode})")
            time.sleep(POLL)
        with open(status_path) as f:
            status = json.load(f)
        with open(output, errors="replace") as f:
            text = f.read()
        for path in (output, status_path, stdin_path):
            if path:
                os.remove(path)
        return (None if status.get("timeout") else status["returncode"]), text

    def close(self):
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.work, ignore_errors=True)


_LAUNCHERS: Dict[int, WarmLauncher] = {}
_STARTING = threading.Lock()  # the bad-input catalogue calls from two threads at once: one server, not two


def launcher(env: Dict[str, str]) -> Optional[WarmLauncher]:
    """This process's server, if it can serve a run with ``env``; None where a fresh interpreter must."""
    if os.environ.get("MOE_TEST_COLD_CLI") == "1":
        return None
    with _STARTING:
        mine = _LAUNCHERS.get(os.getpid())
        if mine is None or mine.process.poll() is not None:
            mine = _LAUNCHERS[os.getpid()] = WarmLauncher(env)
    return mine if mine.serves(env) else None


def unserved_variables(env: Dict[str, str]) -> List[str]:
    """Why this process's server does not serve ``env``: the start-up variables that differ (none started: [])."""
    mine = _LAUNCHERS.get(os.getpid())
    return [] if mine is None else startup_difference(mine.env, env)
