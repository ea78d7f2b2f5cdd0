"""What the one-shot's fairseq runs share (oneshot_fairseq.py, oneshot_ranks.py): the corpus, the
training flags, starting a run as a process group of its own with its log, waiting for runs within
the check's deadline, reading what a run logged, and killing every run still alive when the check ends
(``kill_started``, called in a ``finally``)."""

import json
import os
import re
import socket
import subprocess
import sys

from report import DRY_RUN, HERE, LOGS, ROOT, WORK, emit, left, sized

sys.path.insert(0, str(ROOT / "recipes"))  # toy_pair: the toy language pair the tests train on too
import toy_pair  # noqa: E402

RUNS = WORK / "runs"
UPDATES = sized(300, 12)
FALL = sized(0.7, 0.95)  # the last train loss at most this times the first (the dry run trains 12 updates)
STARTED = []  # every process started by this check: (name, Popen)


def corpus():
    """Write and binarize the toy pair (recipes/toy_pair.py; fairseq-preprocess's own main, in this process)."""
    splits = sized({"train": 4000, "valid": 200, "test": 64}, {"train": 300, "valid": 20, "test": 8})
    return toy_pair.binarize(toy_pair.write_parallel_corpus(WORK / "raw", 0, splits), WORK / "bin", splits)


def env():
    """One intra-op thread per run: the runs go side by side (up to a dozen processes on the GPU
    machine's 16 cores, toys on the dry run's CPU), and a second thread per run would only spin."""
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def train_flags(data, save_dir, *extra, seed=1):
    import fairseq_moe_ext

    fixed = (
        "--arch moe_transformer_tiny --criterion moe_label_smoothed_cross_entropy --label-smoothing 0.1 "
        "--optimizer adam --lr 3e-3 --lr-scheduler inverse_sqrt --warmup-updates 30 --clip-norm 1.0 "
        "--num-workers 0 --no-epoch-checkpoints --log-format json"
    ).split()
    return [
        *[str(data), "--user-dir", fairseq_moe_ext.PACKAGE_DIR, *fixed, "--save-dir", str(save_dir)],
        *["--max-tokens", str(sized(2000, 400)), "--max-update", str(UPDATES), "--seed", str(seed)],
        # every update logged: the verdicts compare runs update by update (loss and gradient norm)
        *["--log-interval", "1", *(["--cpu"] if DRY_RUN else []), *extra],
    ]


# The dry run's planted faults (oneshot_plant.py), by run name: ONESHOT_PLANT=two_ranks_gloo_c10d=wrong_scale,...
PLANTED = dict(p.split("=", 1) for p in os.environ.get("ONESHOT_PLANT", "").split(",") if "=" in p) if DRY_RUN else {}


def planted(name, command):
    """``command`` (``... -m fairseq_cli.train ...``), or with a planted fault: oneshot_plant.py in its place."""
    if name not in PLANTED:
        return command
    at = command.index("fairseq_cli.train")
    return [*command[: at - 1], str(HERE / "oneshot_plant.py"), PLANTED[name], *command[at + 1 :]]


def start(name, command):
    log = open(LOGS / "fairseq" / f"{name}.log", "w")
    process = subprocess.Popen(
        planted(name, command), stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=str(WORK), start_new_session=True
    )
    log.close()  # the child holds its own descriptor
    STARTED.append((name, process))
    return name, process


def wait_all(started, margin=20):
    """{name: exit status, None if killed at the deadline}."""
    status = {}
    for name, process in started:
        try:
            status[name] = process.wait(timeout=max(left() - margin, 1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            status[name] = None
    return status


def kill_started():
    """Every run this check started that is still alive, with its children (torchrun's ranks)."""
    for name, process in STARTED:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
            emit("INFO", f"fairseq_{name}", "still running when the check ended: killed")


def read_log(name):
    return (LOGS / "fairseq" / f"{name}.log").read_text(errors="replace")


def records(text, tag):
    pattern = re.compile(rf"\| {tag} \| (\{{.*\}})\s*$")
    return [json.loads(m.group(1)) for line in text.splitlines() if (m := pattern.search(line))]


def by_update(name):
    """{update: (train loss, gradient norm)} of a run logged at every update."""
    text = read_log(name)
    return {int(r["num_updates"]): (float(r["loss"]), float(r["gnorm"])) for r in records(text, "train_inner")}


def outcome(name, status):
    """(train losses, final valid loss, skipped steps, exit status, last line) of one run."""
    text = read_log(name)
    train = [float(r["loss"]) for r in records(text, "train_inner")]
    valid = [float(r["valid_loss"]) for r in records(text, "valid")]
    skipped = len(re.findall(r"gradient overflow detected|AMP: skipping this batch", text))
    last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
    return train, (valid[-1] if valid else None), skipped, status, last[0][-200:]


def failed_run(name, result):
    train, valid, _, status, last = result
    if status == 0 and train and valid is not None:
        return False
    said = "killed at the deadline" if status is None else f"exit {status}"
    emit("FAIL", name, f"{said}, {len(train)} train records, valid {valid}: {last}")
    return True


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
