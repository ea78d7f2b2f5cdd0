"""The size rules of docs/testing.md hold over the whole tree, so that they stay true without a reviewer."""

import ast
import re
import subprocess
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
