"""recipes/heal_pruned.py refuses, in one line and before it trains anything, a --dialects name the test set lacks."""

import json
import sys

import pytest

from support.launch.paths import REPO_ROOT as ROOT

sys.path.insert(0, str(ROOT / "recipes"))
from heal_pruned import main  # noqa: E402


def test_a_dialect_the_test_set_lacks_is_named_with_the_ones_it_has(tmp_path, capsys):
    work, pruning = tmp_path / "work", tmp_path / "work" / "pruning"
    (work / "data" / "raw").mkdir(parents=True)
    pruning.mkdir()
    (work / "common_args.txt").write_text("data-bin\n--cpu\n")
    (work / "data" / "raw" / "test.domain").write_text("harbor\nlowland\nharbor\n")
    (work / "data" / "raw" / "test.tgt").write_text("a\nb\nc\n")
    (pruning / "results.json").write_text(json.dumps({"full": {}, "by_fraction": {}}))
    with pytest.raises(SystemExit) as exit_:
        main(["--work", str(work), "--pruning", str(pruning), "--dialects", "harbor", "upland"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("--dialects upland: not a dialect of the test set (it has harbor lowland)"), err
    assert not (pruning / "heal").exists()  # nothing trained, nothing written
