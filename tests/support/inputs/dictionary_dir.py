"""The ``data`` fixture of the in-process fairseq tests (tests/fairseq, tests/interop, tests/parallel): a data
directory holding dictionaries only, enough to build the models of tiny_fairseq_models.py. Each of those
folders' conftest.py imports it, so the three share one definition."""

import pytest

from support.launch.fairseq_helpers import VOCAB


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A data directory of dictionaries only (dict.src.txt, dict.tgt.txt, dict.txt), enough to build
    the models of tests/support/inputs/tiny_fairseq_models.py."""
    from fairseq.data import Dictionary

    root = tmp_path_factory.mktemp("dictionaries")
    for name, prefix in (("dict.src.txt", "s"), ("dict.tgt.txt", "t"), ("dict.txt", "w")):
        dictionary = Dictionary()
        for i in range(VOCAB):
            dictionary.add_symbol(f"{prefix}{i}")
        dictionary.save(str(root / name))
    return root
