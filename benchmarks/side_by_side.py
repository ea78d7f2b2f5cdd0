"""What the end-to-end benchmarks (train_wps.py, generate_throughput.py, main_job_wall.py) share: the folder
their runs go to, the header line that dates them, and the load average each arm's runs saw (they alternate
the arms, so a drift in the machine's load hits every arm alike; the range says how loaded it was)."""

import datetime
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


def run_folder(keep, prefix: str) -> Path:
    """``keep`` (made if missing) or a fresh temporary folder."""
    folder = Path(keep) if keep else Path(tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def stamp() -> str:
    """When and where, for a header line: the date, the CPUs and the load average now."""
    now = datetime.datetime.now().astimezone()
    return f"{now:%Y-%m-%d %H:%M %Z}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}"


class Loads:
    """The load average before and after every run of each arm."""

    def __init__(self):
        self.seen = {}

    @contextmanager
    def run(self, arm):
        before = os.getloadavg()[0]
        yield
        self.seen.setdefault(arm, []).extend([before, os.getloadavg()[0]])

    def range(self, arm) -> str:
        return f"{min(self.seen[arm]):.1f}-{max(self.seen[arm]):.1f}"
