"""Fixtures of the checkpoint tests."""

from pathlib import Path

import pytest

from fairseq_moe_ext import checkpoint as moe_ckpt
from support.inputs.fake_checkpoints import full_state


@pytest.fixture
def a_set(tmp_path) -> Path:
    """A 2-worker set ``set/checkpoint_last`` written by the checkpoint tool's code."""
    (tmp_path / "set").mkdir()
    moe_ckpt.save_set(full_state(), str(tmp_path / "set" / "checkpoint_last"), 2)
    return tmp_path / "set"
