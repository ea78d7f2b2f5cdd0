"""fairseq's command-line tools started from a process that has already imported fairseq, for the suite.

``python -m fairseq_cli.train ARGS`` spends about 2.5 s of CPU importing torch and fairseq before it reads its
arguments, and the suite starts over a hundred such runs (most of the bad-input catalogue fails while parsing).
Run as a script, this module is a server: it imports fairseq once (with the environment the suite gives every
fairseq subprocess, ``fairseq_helpers.fairseq_env()``), then forks one child per request. The child does what a
fresh ``python -m fairseq_cli.<tool>`` does after its first import: it takes the request's environment, working
directory, stdin and argv, runs the module as ``__main__`` (``runpy``, as ``-m`` does, with the working directory
first on ``sys.path``), and exits the way the interpreter would (``SystemExit`` codes and messages, a traceback and
status 1 for an uncaught exception, non-daemon threads joined, ``atexit`` handlers run). The package under test
is imported by the child, through ``--user-dir``, as in a real run: the server imports only fairseq. What a
child's output lacks against a fresh interpreter's: what fairseq's import itself prints (one tensorboardX
notice, import-time warnings), which went to the server's stderr once.

Protocol: one JSON line per request on the server's stdin ``{"id", "module", "args", "env", "cwd", "stdin",
"output", "timeout"}``; the child's stdout and stderr go to ``output``; when it ends the server writes
``<output>.status`` (``{"returncode": N}`` or ``{"timeout": true}``, by rename, so a reader never sees half of
it). One request at a time per caller, several callers at once (each waits for its own status file).
``MOE_TEST_COLD_CLI=1`` turns the server off: every run is a fresh interpreter again.
"""

import atexit
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, Optional, Tuple

POLL = 0.02  # seconds between looks at the children (the server) and at the status file (the client)


# Variables read when the interpreter, torch or its thread pools start: a request whose values differ from the
# server's cannot be served by a fork of it and runs in a fresh interpreter instead.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS", "TORCH", "CUDA", "LD_")


def _run_child(request, protocol_fds):
    """In the forked child: become the requested command line, run it, exit as the interpreter would."""
    import logging
    import runpy
    import traceback

    code = 1
    try:
        os.setpgid(0, 0)  # the timeout kills the child's whole process group
        for fd in protocol_fds:
            os.close(fd)
        output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        source = os.open(request.get("stdin") or os.devnull, os.O_RDONLY)
        os.dup2(source, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        os.close(source)
        sys.stdin = open(0, "r", closefd=False)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        sys.argv = [request["module"], *request["args"]]
        # fairseq's CLIs configure logging before they import fairseq; here fairseq's import came first, and a
        # module-level logging.info in it gave the root logger Python's default handler. A fresh interpreter's
        # root logger has none, so that the CLI's basicConfig takes effect.
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.setLevel(logging.WARNING)
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as done:
            if done.code is None:
                code = 0
            elif isinstance(done.code, int):
                code = done.code
            else:
                print(done.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # the interpreter joins non-daemon threads, then runs atexit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _write_status(path, status):
    with open(path + ".tmp", "w") as f:
        json.dump(status, f)
    os.replace(path + ".tmp", path)


def serve():
    """The server's loop: read requests, fork, reap, enforce timeouts. Single-threaded, so forking is safe."""
    requests_fd, replies_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # nothing the imports print can reach the protocol
    import fairseq  # noqa: F401  (the point of the server)

    os.write(replies_fd, b"ready\n")
    running = {}  # pid -> (status path, deadline)
    pending = b""
    while True:
        ready, _, _ = select.select([requests_fd], [], [], POLL)
        if ready:
            chunk = os.read(requests_fd, 1 << 16)
            if not chunk:  # the suite is done
                for pid in running:
                    os.killpg(pid, signal.SIGKILL)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run_child(request, (requests_fd, replies_fd))
                running[pid] = (request["output"] + ".status", time.monotonic() + request["timeout"])
        for pid, (status, deadline) in list(running.items()):
            done, wait_status = os.waitpid(pid, os.WNOHANG)
            if done:
                del running[pid]
                _write_status(status, {"returncode": os.waitstatus_to_exitcode(wait_status)})
            elif time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                del running[pid]
                _write_status(status, {"timeout": True})


class WarmLauncher:
    """The suite's side: one server per pytest process, started on first use, stopped at exit."""

    def __init__(self, env: Dict[str, str]):
        self.env = dict(env)
        here = os.path.dirname(os.path.abspath(__file__))
        command = [sys.executable, os.path.abspath(__file__)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, cwd=here)
        if self.process.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the warm fairseq server did not start (exit {self.process.wait()})")
        self.work = tempfile.mkdtemp(prefix="warm-fairseq-")
        self.lock = threading.Lock()
        self.numbers = itertools.count()
        atexit.register(self.close)

    def serves(self, env: Dict[str, str]) -> bool:
        startup = lambda e: {k: v for k, v in e.items() if k.startswith(STARTUP_PREFIXES)}  # noqa: E731
        return self.process.poll() is None and startup(env) == startup(self.env)

    def run(self, module, args, env, cwd, stdin_text, timeout) -> Tuple[Optional[int], str]:
        """(exit status, or None after ``timeout`` seconds; stdout and stderr together)."""
        number = next(self.numbers)
        output = os.path.join(self.work, f"{number}.out")
        stdin_path = None
        if stdin_text is not None:
            stdin_path = os.path.join(self.work, f"{number}.in")
            with open(stdin_path, "w") as f:
                f.write(stdin_text)
        request = dict(module=module, args=[str(a) for a in args], env=env, cwd=str(cwd or os.getcwd()))
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


if __name__ == "__main__":
    serve()
