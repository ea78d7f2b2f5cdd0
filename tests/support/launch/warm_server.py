"""The warm server of warm_fairseq.py: run as a script, it imports fairseq once (with the environment the suite
gives every fairseq subprocess, ``fairseq_helpers.fairseq_env()``), then forks one child per requested process.

A child does what a fresh ``python -m MODULE`` or ``python SCRIPT`` does after its first import: it takes the
request's environment, working directory, stdin and argv, runs the module or script as ``__main__`` (``runpy``, with
the working directory or the script's directory first on ``sys.path``), and exits the way the interpreter would
(``SystemExit`` codes and messages, ``sys.excepthook`` and status 1 for an uncaught exception, non-daemon threads
joined, ``atexit`` handlers run). The package under test is imported by the child, through ``--user-dir``, as in a
real run: the server imports only fairseq. What a child's output lacks against a fresh interpreter's: what
fairseq's import itself prints (one tensorboardX notice, import-time warnings), which went to the server's stderr.
A request of several processes is a torchrun launch: when one fails the server stops the others (SIGTERM, SIGKILL
after ``STOP_GRACE`` seconds), as torchrun's agent does, appends a line naming the rank that failed first, and
reports status 1.

Protocol: one JSON line per request on stdin ``{"target": {"module"|"path": ...}, "args", "cwd", "stdin",
"output", "timeout", "ranks": [{"env", "stdout", "stderr"}, ...]}``; ``output`` collects what no rank sends to a
file of its own; when the run ends the server writes ``<output>.status`` (``{"returncode": N}`` or
``{"timeout": true}``, by rename, so a reader never sees half of it).
"""

import atexit
import json
import os
import select
import signal
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

POLL = 0.02  # seconds between looks at the children (the server) and at the status file (the client)
STOP_GRACE = 30.0  # seconds the other workers of a failed launch get between SIGTERM and SIGKILL (torchrun's)


def _run_child(request, rank, protocol_fds):
    """In the forked child: become rank ``rank`` of the requested command line, run it, exit as Python would."""
    import logging
    import runpy

    code = 1
    try:
        os.setpgid(0, 0)  # a timeout or a failed peer stops the child's whole process group
        for fd in protocol_fds:
            os.close(fd)
        files = request["ranks"][rank]
        source = os.open(request.get("stdin") or os.devnull, os.O_RDONLY)
        os.dup2(source, 0)
        os.close(source)
        for fd, path in ((1, files["stdout"]), (2, files["stderr"])):
            sink = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # ranks share the launcher's output
            os.dup2(sink, fd)
            os.close(sink)
        sys.stdin = open(0, "r", closefd=False)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(files["env"])
        # A fresh interpreter's root logger has no handler until the target configures logging or imports
        # fairseq, whose import configures it where nothing has (logging.basicConfig(level=DEBUG) in a wav2vec
        # module: a stderr handler). fairseq-train configures it first (its log on stdout), fairseq-generate
        # imports fairseq first (its log on stderr): the server's import is replayed at the target's first one.
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.setLevel(logging.WARNING)
        sys.meta_path.insert(0, _FirstImportOfFairseq(sys.modules.pop("fairseq")))
        sys.excepthook = sys.__excepthook__  # torch's init_process_group wraps it with "[rankN]: " prefixes
        target = request["target"]
        try:
            if "module" in target:
                sys.path[0] = os.getcwd()  # what `python -m` puts first
                sys.argv = [target["module"], *request["args"]]
                runpy.run_module(target["module"], run_name="__main__", alter_sys=True)
            else:
                sys.path[0] = os.path.dirname(os.path.realpath(target["path"]))  # what `python SCRIPT` puts first
                sys.argv = [target["path"], *request["args"]]
                runpy.run_path(target["path"], run_name="__main__")
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
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # the interpreter joins non-daemon threads, then runs atexit
        atexit._run_exitfuncs()
    except BaseException:
        sys.__excepthook__(*sys.exc_info())
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


class _FirstImportOfFairseq:
    """A meta-path entry for the child: the target's first ``import fairseq`` returns the server's module (no
    second import) and does to logging what that import did in a fresh interpreter."""

    def __init__(self, module):
        self.module, self.spec = module, module.__spec__

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery

        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name == "fairseq" else None

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        import logging

        sys.meta_path.remove(self)
        module.__spec__ = self.spec  # the import machinery put this entry's spec on it
        logging.basicConfig(level=logging.DEBUG)


def _write_status(path, status):
    with open(path + ".tmp", "w") as f:
        json.dump(status, f)
    os.replace(path + ".tmp", path)


class _Launch:
    """One request's children in the server: their exits, the first failure, the deadlines."""

    def __init__(self, request, pids: List[int]):
        self.output, self.pids = request["output"], pids
        self.deadline = time.monotonic() + request["timeout"]
        self.codes: Dict[int, int] = {}  # rank -> exit status
        self.failed: Optional[Tuple[int, int]] = None  # (rank, status) of the first rank that failed
        self.kill_at: Optional[float] = None

    def signal(self, sig):
        for rank, pid in enumerate(self.pids):
            if rank not in self.codes:
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass

    def reap(self) -> bool:
        """Collect exits; stop the others after a failure, as torchrun's agent does; True when the launch is over."""
        for rank, pid in enumerate(self.pids):
            if rank in self.codes:
                continue
            done, wait_status = os.waitpid(pid, os.WNOHANG)
            if done:
                self.codes[rank] = os.waitstatus_to_exitcode(wait_status)
                if self.codes[rank] != 0 and self.failed is None and len(self.pids) > 1:
                    self.failed = (rank, self.codes[rank])
                    self.signal(signal.SIGTERM)
                    self.kill_at = time.monotonic() + STOP_GRACE
        now = time.monotonic()
        if now > self.deadline:
            self.signal(signal.SIGKILL)
            for rank, pid in enumerate(self.pids):
                if rank not in self.codes:
                    os.waitpid(pid, 0)
            _write_status(self.output + ".status", {"timeout": True})
            return True
        if self.kill_at is not None and now > self.kill_at:
            self.signal(signal.SIGKILL)
        if len(self.codes) < len(self.pids):
            return False
        if len(self.pids) == 1:
            returncode = self.codes[0]
        elif self.failed is not None:
            returncode = 1  # torchrun's status when a worker failed
            with open(self.output, "a") as f:
                f.write(f"[warm launcher] rank {self.failed[0]} exited with status {self.failed[1]} first; ")
                f.write("the others were stopped\n")
        else:
            returncode = 0
        _write_status(self.output + ".status", {"returncode": returncode})
        return True


def serve():
    """The server's loop: read requests, fork, reap, enforce timeouts. Single-threaded, so forking is safe."""
    requests_fd, replies_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # nothing the imports print can reach the protocol
    import fairseq  # noqa: F401  (the point of the server)

    os.write(replies_fd, b"ready\n")
    launches: List[_Launch] = []
    pending = b""
    while True:
        ready, _, _ = select.select([requests_fd], [], [], POLL)
        if ready:
            chunk = os.read(requests_fd, 1 << 16)
            if not chunk:  # the suite is done
                for launch in launches:
                    launch.signal(signal.SIGKILL)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                open(request["output"], "w").close()  # the ranks append to it
                sys.stdout.flush()
                sys.stderr.flush()
                pids = []
                for rank in range(len(request["ranks"])):
                    pid = os.fork()
                    if pid == 0:
                        _run_child(request, rank, (requests_fd, replies_fd))
                    pids.append(pid)
                launches.append(_Launch(request, pids))
        launches = [launch for launch in launches if not launch.reap()]


if __name__ == "__main__":
    serve()
