"""The suite's start-up shortcut (recipes/lib/lean_imports/sitecustomize.py): the fairseq processes that
tests start import scikit-learn and scipy.stats only when something calls into them, and such a
call gets the real function."""

import subprocess
import sys

import pytest

from support.launch.fairseq_helpers import fairseq_env

pytestmark = pytest.mark.slow

PROGRAM = """
import sys
import fairseq_cli.train
from fairseq.criterions import sentence_prediction
stand_ins = sorted(n for n in ("sklearn", "sklearn.metrics", "scipy.stats") if type(sys.modules.get(n)).__name__ == "_StandIn")
print("deferred", stand_ins)
print("f1", sentence_prediction.f1_score([1, 0, 1, 1], [1, 1, 1, 0]))
print("now", type(sys.modules["sklearn.metrics"]).__name__, type(sys.modules["scipy.stats"]).__name__)
"""


def test_fairseq_under_tests_imports_scikit_learn_only_when_called_and_the_real_one():
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=fairseq_env(), capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = dict(
        line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ")[0] in ("deferred", "f1", "now")
    )
    assert said["deferred"] == "['scipy.stats', 'sklearn', 'sklearn.metrics']", done.stdout
    # y_true 1 0 1 1, y_pred 1 1 1 0: 2 true positives, 1 false positive, 1 false negative: F1 = 2/3.
    assert float(said["f1"]) == pytest.approx(2 / 3)
    assert said["now"] == "module module", "the real modules replace the stand-ins once called"
