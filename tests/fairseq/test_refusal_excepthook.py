"""The process-level half of "one line per refusal" (fairseq_integration/cli.py): once the plugin is
installed into fairseq, an ``MoERefusal`` that ends the program prints ``prog: error: <message>`` and exits
with status 2, any other exception its traceback with status 1; under torchrun the line goes to the
worker's error file too. The same through every fairseq entry point: tests/cli/test_bad_input_entry_points.py.
"""

import json
import subprocess
import sys

import pytest

from support.launch.fairseq_helpers import fairseq_env

PROGRAM = """
import sys
sys.argv[0] = "/bin/fairseq-train"
import fairseq, fairseq_moe_ext
from fairseq_moe_ext.common.refusal import MoEOptionError
raise {}
"""


def run(raised: str, **env):
    command = [sys.executable, "-c", PROGRAM.format(raised)]
    return subprocess.run(command, capture_output=True, text=True, env={**fairseq_env(), **env}, timeout=120)


@pytest.mark.slow
def test_a_refusal_is_one_line_with_status_2_and_any_other_error_keeps_its_traceback(tmp_path):
    error_file = tmp_path / "error.json"
    refused = run(
        'MoEOptionError("--moe-top-k 9 exceeds --moe-expert-count 4: use --moe-top-k <= 4")',
        RANK="1",
        WORLD_SIZE="2",
        TORCHELASTIC_ERROR_FILE=str(error_file),
    )
    line = "fairseq-train: error: rank 1 of 2: --moe-top-k 9 exceeds --moe-expert-count 4: use --moe-top-k <= 4"
    assert (refused.returncode, refused.stderr.strip().splitlines()[-1:]) == (2, [line]), refused.stderr
    assert "Traceback" not in refused.stderr
    assert json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"] == line

    bug = run('ValueError("a bug, not a refusal")')
    assert bug.returncode == 1 and "Traceback (most recent call last)" in bug.stderr, bug.stderr
    assert bug.stderr.strip().splitlines()[-1] == "ValueError: a bug, not a refusal"
