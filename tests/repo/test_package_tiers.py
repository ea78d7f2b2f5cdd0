"""The package's tiers (see ``fairseq_moe_ext/__init__.py``): every module imports only from its own
tier and the ones below, and ``moe/`` and ``checkpoint/`` work on a machine without fairseq."""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fairseq_moe_ext

PACKAGE = "fairseq_moe_ext"
ROOT = Path(fairseq_moe_ext.PACKAGE_DIR)

# Lowest first: a module may import its own tier and the ones below.
# fmt: off
TIERS = (
    ("common",),
    ("moe",),
    ("options",),
    ("checkpoint",),
    ("parallel",),
    ("models", "criterions", "tasks"),
    ("training",),
    ("fairseq_integration",),
    ("__init__", "__main__", "console"),
)
# fmt: on
TIER_OF = {part: level for level, parts in enumerate(TIERS) for part in parts}
# The tiers that must import and run where fairseq (and what comes with it) is not installed.
WITHOUT_FAIRSEQ = ("common", "moe", "options", "checkpoint")
FAIRSEQ_ONLY = ("fairseq", "fairseq_cli", "omegaconf", "hydra")
# (importing module, imported module) pairs allowed to reach up, and only from inside a function: the
# checkpoint tool's alias of fairseq-moe (``python -m fairseq_moe_ext.checkpoint``), which imports the registry
# in its main() so importing checkpoint/ never loads what sits above it.
ALLOWED_UPWARD = {("fairseq_moe_ext.checkpoint.__main__", "fairseq_moe_ext.console")}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tier(name: str) -> int:
    """The tier of ``fairseq_moe_ext.<part>[...]``; the package root is the top."""
    parts = name.split(".")
    return TIER_OF[parts[1] if len(parts) > 1 else "__init__"]


def imports_of(path: Path, root: Path = ROOT):
    """(line, absolute name of the imported module, whether the import waits for a call) for every import
    statement in ``path``, at any depth (an import inside a function counts: it runs)."""
    package = module_name(path, root) if path.name == "__init__.py" else module_name(path, root).rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    lazy = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for inner in ast.walk(node)
        if inner is not node
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name, id(node) in lazy) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # ``from .. import checkpoint``: the name is itself a module
                below = root.parent.joinpath(*base.split("."), alias.name)
                is_module = below.is_dir() or below.with_suffix(".py").is_file()
                yield node.lineno, f"{base}.{alias.name}" if is_module else base, id(node) in lazy


def tier_violations(root: Path = ROOT):
    """One line per upward import, and per fairseq import in a tier that must work without fairseq."""
    found = []
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        where = f"{path.relative_to(root.parent)}:"
        own_part = importer.split(".")[1] if "." in importer else "__init__"
        for line, imported, lazy in dict.fromkeys(imports_of(path, root)):
            if imported.split(".")[0] in FAIRSEQ_ONLY and own_part in WITHOUT_FAIRSEQ:
                found.append(f"{where}{line} imports {imported}: {own_part}/ must work without fairseq")
            elif (
                imported.split(".")[0] == PACKAGE
                and tier(imported) > tier(importer)
                and not (lazy and (importer, imported) in ALLOWED_UPWARD)
            ):
                found.append(
                    f"{where}{line} imports {imported} (tier {tier(imported)}) from tier {tier(importer)}: "
                    f"an upward import; move the code it needs down, or the importer up"
                )
    return found


def test_every_module_of_the_package_imports_only_its_own_tier_and_those_below():
    assert not tier_violations(), "\n".join(tier_violations())


REFERENCE = f"{PACKAGE}.moe.reference"  # the naive MoE the layer is checked against (tests, GPU one-shot)


def reference_importers(root: Path = ROOT):
    """Every module of the package that imports the reference MoE: an oracle the code used would check itself."""
    return sorted(
        f"{path.relative_to(root.parent)}:{line}"
        for path in root.rglob("*.py")
        for line, imported, _ in imports_of(path, root)
        if imported == REFERENCE or imported.startswith(REFERENCE + ".")
    )


def test_no_module_of_the_package_imports_the_reference_moe_it_is_checked_against(tmp_path):
    assert (ROOT / "moe" / "reference.py").is_file()
    assert reference_importers() == []
    fake = tmp_path / PACKAGE / "moe"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "reference.py").write_text("")
    (fake / "layer.py").write_text("import torch\n\nfrom .reference import reference_moe\n")
    assert reference_importers(fake.parent) == ["fairseq_moe_ext/moe/layer.py:3"]


def test_every_part_of_the_package_has_a_tier_in_the_table():
    parts = {
        p.stem if p.is_file() else p.name
        for p in ROOT.iterdir()
        if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())
    }
    assert parts == set(TIER_OF)


def test_an_upward_import_is_reported_with_its_file_line_and_the_module_it_reaches(tmp_path):
    fake = tmp_path / PACKAGE
    (fake / "moe").mkdir(parents=True)
    (fake / "checkpoint").mkdir()
    (fake / "common").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "common" / "__init__.py").write_text("")
    (fake / "common" / "config_value.py").write_text("from ..moe.placement import side_moe_freq\n")
    (fake / "moe" / "__init__.py").write_text("")
    (fake / "checkpoint" / "__init__.py").write_text("")
    (fake / "moe" / "layer.py").write_text("import torch\n\nfrom ..checkpoint import names\n")
    (fake / "checkpoint" / "names.py").write_text("def f():\n    import fairseq\n")
    (fake / "checkpoint" / "__main__.py").write_text("from ..training.upcycle_cli import upcycle\n")
    assert tier_violations(fake) == [
        "fairseq_moe_ext/checkpoint/__main__.py:1 imports fairseq_moe_ext.training.upcycle_cli (tier 6) from tier 3: "
        "an upward import; move the code it needs down, or the importer up",
        "fairseq_moe_ext/checkpoint/names.py:2 imports fairseq: checkpoint/ must work without fairseq",
        "fairseq_moe_ext/common/config_value.py:1 imports fairseq_moe_ext.moe.placement (tier 1) from tier 0: an "
        "upward import; move the code it needs down, or the importer up",
        "fairseq_moe_ext/moe/layer.py:3 imports fairseq_moe_ext.checkpoint.names (tier 3) from tier 1: an upward "
        "import; move the code it needs down, or the importer up",
    ]


BLOCK_FAIRSEQ = textwrap.dedent(
    f"""
    import importlib.abc, runpy, sys

    class NoFairseq(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] in {FAIRSEQ_ONLY!r}:
                raise ImportError(f"{{fullname}} is blocked: this machine has no fairseq")

    sys.meta_path.insert(0, NoFairseq())
    """
)


def run_without_fairseq(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT.parent))
    return subprocess.run(
        [sys.executable, "-c", BLOCK_FAIRSEQ + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_moe_and_checkpoint_import_and_the_tool_runs_where_fairseq_cannot_be_imported():
    done = run_without_fairseq(
        """
        import fairseq_moe_ext.moe, fairseq_moe_ext.checkpoint
        from fairseq_moe_ext.moe import MoELayer, MoELayerConfig, RoutingConfig
        import torch
        layer = MoELayer(MoELayerConfig(model_dim=8, hidden_dim=16, num_experts=4, routing=RoutingConfig(k=2)))
        assert layer(torch.randn(3, 8)).shape == (3, 8)
        loaded = sorted(name for name in sys.modules if name.split(".")[0] in {blocked!r})
        assert not loaded, loaded
        sys.argv = ["python -m fairseq_moe_ext.checkpoint", "--help"]
        runpy.run_module("fairseq_moe_ext.checkpoint", run_name="__main__")
        """.replace("{blocked!r}", repr(FAIRSEQ_ONLY))
    )
    assert done.returncode == 0, done.stderr
    assert "upcycle" in done.stdout and "merge" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "first, then",
    [
        ("import fairseq_moe_ext.checkpoint", "from fairseq import checkpoint_utils"),
        ("from fairseq_moe_ext.models import moe_config", "import fairseq_cli.train"),
    ],
)
def test_a_process_that_imported_the_plugin_before_fairseq_has_its_hooks_once_fairseq_loads(first, then):
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
            import sys
            {first}
            assert "fairseq_moe_ext.fairseq_integration" not in sys.modules
            {then}
            import fairseq.checkpoint_utils, fairseq.trainer
            from fairseq.models import ARCH_MODEL_REGISTRY
            assert fairseq.checkpoint_utils.load_checkpoint_to_cpu.__wrapped_by_moe_ext__
            assert fairseq.trainer.Trainer.load_checkpoint.__wrapped_by_moe_ext__
            assert "moe_transformer_lm" in ARCH_MODEL_REGISTRY
            """
            ),
        ],
        env=dict(os.environ, PYTHONPATH=str(ROOT.parent)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "module",
    [
        f"{PACKAGE}.moe",
        f"{PACKAGE}.options",
        f"{PACKAGE}.options.ranges",
        f"{PACKAGE}.checkpoint",
        f"{PACKAGE}.parallel.process_state",
    ],
)
def test_importing_a_fairseq_free_module_leaves_fairseq_unimported(module):
    done = subprocess.run(
        [sys.executable, "-c", f"import sys, {module}; assert 'fairseq' not in sys.modules"],
        env=dict(os.environ, PYTHONPATH=str(ROOT.parent)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
