"""One reader for configuration values (``common/config_value.py``): the same answer from every
kind of config the plugin is handed, and no second reader in the package."""

import argparse
import ast
from pathlib import Path

import pytest

import fairseq_moe_ext
from fairseq_moe_ext.common.config_value import config_value

omegaconf = pytest.importorskip("omegaconf")

VALUES = {"set": 3, "none": None}
# fmt: off
KINDS = {
    "namespace": lambda: argparse.Namespace(**VALUES),
    "dict": lambda: dict(VALUES),
    "omegaconf": lambda: omegaconf.OmegaConf.create(VALUES),
    "omegaconf-struct": lambda: _struct(omegaconf.OmegaConf.create(VALUES)),  # fairseq's cfg sections
}
# fmt: on


def _struct(cfg):
    omegaconf.OmegaConf.set_struct(cfg, True)
    return cfg


@pytest.mark.parametrize("kind", KINDS)
def test_a_value_a_none_and_a_missing_key_read_the_same_from_every_kind_of_config(kind):
    cfg = KINDS[kind]()
    assert config_value(cfg, "set", 7) == 3
    assert config_value(cfg, "none", 7) is None, "a None is returned as None: unset is the caller's call"
    assert config_value(cfg, "missing", 7) == 7
    assert config_value(cfg, "missing") is None


def test_a_config_that_is_not_there_reads_as_the_default():
    assert config_value(None, "set", 7) == 7


# Readers of a config by name with a fallback: getattr(cfg, "name", default) and fairseq's safe_getattr.
# safe_getattr stays only where fairseq's architecture idiom wants it (None: not given on the command
# line, so the architecture's default), in the architecture functions.
ARCHITECTURE_DEFAULTS = {"fairseq_moe_ext/models/moe_transformer.py"}


def is_config(node) -> bool:
    """``args``, ``cfg``, ``options``, ``*_cfg`` and their attributes (``cfg.model``, ``self.options``)."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    inner = isinstance(node, ast.Attribute) and is_config(node.value)
    return name in ("args", "cfg", "options") or name.endswith("_cfg") or inner


def second_readers(path: Path, relative: str):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        name_is_text = (
            len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
        )
        if node.func.id == "getattr" and len(node.args) == 3 and name_is_text and is_config(node.args[0]):
            yield f"{relative}:{node.lineno} getattr(..., {node.args[1].value!r}, default)"
        if node.func.id == "safe_getattr" and relative not in ARCHITECTURE_DEFAULTS:
            yield f"{relative}:{node.lineno} safe_getattr"


def test_no_module_of_the_package_reads_a_config_value_by_a_second_reader():
    root = Path(fairseq_moe_ext.PACKAGE_DIR)
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = str(path.relative_to(root.parent))
        if relative != "fairseq_moe_ext/common/config_value.py":
            found.extend(second_readers(path, relative))
    assert not found, "read config values with common.config_value.config_value:\n" + "\n".join(found)
