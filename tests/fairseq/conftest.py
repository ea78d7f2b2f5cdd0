"""Fixtures of these in-process fairseq tests: ``data``, a directory of dictionaries (shared definition)."""

from support.inputs.dictionary_dir import data  # noqa: F401  (a fixture)
