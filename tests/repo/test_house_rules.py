"""The size rules of docs/testing.md hold over the whole tree, so that they stay true without a reviewer."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOST_LINES = 350  # a file a reader takes in top to bottom
MOST_TEST_NAME = 88  # a promise stated in one line of a test report


def tracked_python_and_shell_files() -> list:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if listed.returncode == 0 and listed.stdout.strip():
        return [ROOT / name for name in listed.stdout.split()]
    # Not a git checkout (an unpacked release): every such file but the virtual environment's.
    return [p for p in [*ROOT.rglob("*.py"), *ROOT.rglob("*.sh")] if ".venv" not in p.parts]


def test_no_source_test_or_script_file_is_longer_than_350_lines():
    files = tracked_python_and_shell_files()
    assert len(files) > 100, "the file list came back (nearly) empty: the check would pass on nothing"
    too_long = [
        f"{f.relative_to(ROOT)}: {n} lines" for f in files if (n := len(f.read_text().splitlines())) > MOST_LINES
    ]
    assert not too_long, f"split these files (at most {MOST_LINES} lines):\n" + "\n".join(too_long)


def test_every_test_name_states_its_promise_in_at_most_88_characters():
    names = [
        (f.relative_to(ROOT), name)
        for f in (ROOT / "tests").rglob("test_*.py")
        for name in re.findall(r"^(?:async )?def (test_\w+)\(", f.read_text(), re.M)
    ]
    assert len(names) > 300, "few test functions found: the check would pass on nothing"
    too_long = [f"{f}: {name} ({len(name)})" for f, name in names if len(name) > MOST_TEST_NAME]
    assert not too_long, f"shorten these test names (at most {MOST_TEST_NAME} characters):\n" + "\n".join(too_long)


def imported_modules(tree: ast.AST) -> set:
    """Every module an import statement anywhere in ``tree`` names, and each of its dotted parts."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found = [node.module or ""] + [alias.name for alias in node.names if not node.module]
        else:
            continue
        names.update(part for name in found for part in name.split("."))
    return names


def test_no_module_of_the_tree_imports_a_test_module_whose_helpers_belong_in_support():
    test_modules = {f.stem for f in (ROOT / "tests").rglob("test_*.py")}
    files = [f for f in tracked_python_and_shell_files() if f.suffix == ".py"]
    assert len(test_modules) > 50 and len(files) > 100, "few files found: the check would pass on nothing"
    offenders = [
        f"{f.relative_to(ROOT)} imports {', '.join(sorted(found))}"
        for f in files
        if (found := imported_modules(ast.parse(f.read_text())) & test_modules)
    ]
    assert not offenders, "move what these share to tests/support/ (docs/testing.md):\n" + "\n".join(offenders)


SHARED_TREES = ("benchmarks", "recipes")  # what users run: they may share modules with tests, never import them
IMPORT_PATH = re.compile(r"sys\.path|PYTHONPATH|addsitedir")


def names_the_tests_tree(text: str) -> bool:
    return "tests" in re.split(r"[/\\]", text)


def reaches_into_tests(path: Path, test_names: set) -> list:
    """How ``path`` (a Python or shell file of benchmarks/ or recipes/) reaches into tests/: a module it imports
    that only tests/ has, or a tests/ folder it puts on the import path (sys.path, PYTHONPATH)."""
    text = path.read_text()
    if path.suffix == ".sh":
        lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
        return [
            f"puts tests/ on PYTHONPATH: {line.strip()}" for line in lines if "PYTHONPATH" in line and "tests/" in line
        ]
    tree = ast.parse(text)
    imported = {
        alias.name.split(".")[0] if isinstance(node, ast.Import) else (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and not node.level)
        for alias in node.names
    }
    found = [f"imports {name} from tests/" for name in sorted(imported & test_names)]
    if IMPORT_PATH.search(text):  # then no string of its code may name tests/ (docstrings aside)
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node) is not None
        }
        found += [
            f"line {node.lineno} names tests/ ({node.value!r}) in a file that sets the import path"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            if names_the_tests_tree(node.value)
        ]
    return found


def test_no_benchmark_or_recipe_imports_from_tests_or_puts_a_tests_folder_on_the_import_path(tmp_path):
    test_names = {"tests", *(f.stem for f in (ROOT / "tests").rglob("*.py"))}
    files = [f for f in tracked_python_and_shell_files() if f.relative_to(ROOT).parts[0] in SHARED_TREES]
    assert len(files) > 40 and {"fairseq_helpers", "paths", "conftest"} <= test_names, "the check would see nothing"
    offenders = [f"{f.relative_to(ROOT)} {why}" for f in files for why in reaches_into_tests(f, test_names)]
    assert not offenders, "move what both need to recipes/ or the package (docs/testing.md):\n" + "\n".join(offenders)
    # Each way in is seen: an import, a folder put on sys.path (through a loop), a shell PYTHONPATH.
    (tmp_path / "a.py").write_text(
        '"""Not tests/ here."""\nimport sys\nfor p in (ROOT / "tests" / "support",):\n    sys.path.insert(0, str(p))\n'
    )
    (tmp_path / "b.py").write_text("def f():\n    from fairseq_helpers import torchrun\n")
    (tmp_path / "c.sh").write_text('# tests/ in a comment\nexport PYTHONPATH="$ROOT/tests/support:$ROOT"\n')
    (tmp_path / "d.py").write_text('import toy_pair\nSKIP = {"tests"}  # a folder name, with no import path set\n')
    assert [reaches_into_tests(tmp_path / name, test_names) for name in ("a.py", "b.py", "c.sh", "d.py")] == [
        ["line 3 names tests/ ('tests') in a file that sets the import path"],
        ["imports fairseq_helpers from tests/"],
        ['puts tests/ on PYTHONPATH: export PYTHONPATH="$ROOT/tests/support:$ROOT"'],
        [],
    ]


def support_layout_problems(support: Path, import_path: list, importers: list) -> list:
    """What breaks tests/support's rule: a folder per kind (oracles/, inputs/, launch/, probes/), imported as
    the package ``support.<kind>`` (so a call site shows the kind), none of them on sys.path, no file loose
    beside them, no module name in two of them, and no file of ``importers`` importing a support module by
    its bare name (a probe, a script run by path, imports its own siblings so and is not among them)."""
    kinds = sorted(p for p in support.iterdir() if p.is_dir() and p.name != "__pycache__")
    problems = [
        f"{p.name}: loose in tests/support; move it to the folder of its kind" for p in support.iterdir() if p.is_file()
    ]
    problems += [
        f"{k.name}/: on sys.path; import its modules as support.{k.name}.<module>"
        for k in kinds
        if str(k) in import_path
    ]
    where: dict = {}
    for kind in kinds:
        for module in sorted(kind.glob("*.py")):
            if module.stem in where:
                problems.append(f"{module.stem}: in {where[module.stem]}/ and {kind.name}/; one module per name")
            where.setdefault(module.stem, kind.name)
    for path in importers:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bare = [alias.name for alias in node.names if alias.name.split(".")[0] in where]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                bare = [node.module] if node.module.split(".")[0] in where else []
            else:
                bare = []
            problems += [
                f"{path.name}:{node.lineno} imports {name} by its bare name: from support.{where[name.split('.')[0]]}."
                f"{name} import ..."
                for name in bare
            ]
    return problems


def test_tests_support_holds_one_package_per_kind_imported_by_its_kind(tmp_path):
    support = ROOT / "tests" / "support"
    assert len([p for p in support.iterdir() if p.is_dir()]) >= 4 and len(list(support.rglob("*.py"))) > 30
    importers = [f for f in (ROOT / "tests").rglob("*.py") if f.parent != support / "probes"]
    assert len(importers) > 100
    assert support_layout_problems(support, sys.path, importers) == []
    fake = tmp_path / "support"
    for kind, module in (("oracles", "moe_math"), ("launch", "runner"), ("launch", "moe_math")):
        (fake / kind).mkdir(parents=True, exist_ok=True)
        (fake / kind / f"{module}.py").write_text("")
    (fake / "helper.py").write_text("")
    (tmp_path / "test_a.py").write_text(
        "from runner import go\nfrom support.launch.runner import go\nimport moe_math\n"
    )
    assert sorted(support_layout_problems(fake, [str(fake / "launch")], [tmp_path / "test_a.py"])) == [
        "helper.py: loose in tests/support; move it to the folder of its kind",
        "launch/: on sys.path; import its modules as support.launch.<module>",
        "moe_math: in launch/ and oracles/; one module per name",
        "test_a.py:1 imports runner by its bare name: from support.launch.runner import ...",
        "test_a.py:3 imports moe_math by its bare name: from support.launch.moe_math import ...",
    ]
