"""The ``--log-format json`` records in fairseq's logs: one reader for the recipes' summaries and plots, the
benchmarks and the tests."""

import json
import re
from typing import List

# fairseq's own log lines ("... | INFO | train_inner | {...}") and hydra's ("[...][train_inner][INFO] - {...}").
JSON_RECORD = re.compile(r"(?:\| |\[)(train_inner|train|valid)(?: \| |\]\[INFO\] - )(\{.*\})\s*$")


def json_records(output: str, kind: str = "train_inner") -> List[dict]:
    """The records of one kind (``train_inner``, ``train`` or ``valid``) in ``output``, in order."""
    records = []
    for line in output.splitlines():
        match = JSON_RECORD.search(line)
        if match and match.group(1) == kind:
            records.append(json.loads(match.group(2)))
    return records
