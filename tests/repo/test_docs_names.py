"""What the docs name exists: every module a package docstring's map names is a file of the package, and every
``--moe-*`` flag an example in the docs passes is an option the plugin registers, with a value among its choices
where it has choices. A module moved or an option renamed fails here, not in a user's terminal."""

import ast
import re
from pathlib import Path

import fairseq_moe_ext
from fairseq_moe_ext.options import OPTIONS

PACKAGE = Path(fairseq_moe_ext.PACKAGE_DIR)
ROOT = PACKAGE.parent
MODULE = re.compile(r"``([\w/]+\.py)``")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
FLAG = re.compile(r"(--moe-[a-z0-9-]+)(?:[ =]+(?!-)([^\s\\'\"`:,;()]+))?")
FLAGS = {o.flag: o for o in OPTIONS.values()}


def missing_modules(docstring: str, package: Path) -> list:
    """The ``x.py`` / ``dir/x.py`` a docstring of ``package`` names that no file is: a path is looked for under
    the package, the plugin's root and the repository; a bare name anywhere under the package."""
    missing = []
    for name in MODULE.findall(docstring):
        if "/" in name:
            found = any((base / name).is_file() for base in (package, PACKAGE, ROOT))
        else:
            found = any(package.rglob(name))
        if not found:
            missing.append(name)
    return missing


def test_every_module_a_package_docstring_names_exists():
    packages = [p.parent for p in PACKAGE.rglob("__init__.py")]
    assert len(packages) > 8, "few packages found: the check would pass on nothing"
    problems = [
        f"{(package / '__init__.py').relative_to(ROOT)} names {name}, which is no file"
        for package in packages
        for name in missing_modules(ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or "", package)
    ]
    assert not problems, "\n".join(problems)


def unknown_flags(markdown: str) -> list:
    """Each ``--moe-*`` flag an example (a fenced block) passes that no option record registers, or with a value
    that is not one of its choices."""
    problems = []
    for block in FENCE.findall(markdown):
        for flag, value in FLAG.findall(block):
            option = FLAGS.get(flag)
            if option is None:
                problems.append(f"{flag}: no such option")
            elif option.choices and value and value not in option.choices and not value.startswith("$"):
                problems.append(f"{flag} {value}: not one of {', '.join(option.choices)}")
    return problems


def test_every_moe_flag_an_example_in_the_docs_passes_exists_with_a_valid_choice():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    examples = sum(len(FENCE.findall(page.read_text())) for page in pages)
    assert examples > 20, "few examples found: the check would pass on nothing"
    problems = [f"{page.relative_to(ROOT)}: {line}" for page in pages for line in unknown_flags(page.read_text())]
    assert not problems, "\n".join(problems)


def test_the_checks_see_a_moved_module_a_renamed_flag_and_a_wrong_choice(tmp_path):
    (tmp_path / "here.py").write_text("")
    assert missing_modules("``here.py`` and ``gone.py`` and ``moe/layer.py``", tmp_path) == ["gone.py"]
    page = "text --moe-gone 1\n```bash\nfairseq-train --moe-router sigmoid --moe-routr top --moe-router topp\n```\n"
    assert unknown_flags(page) == ["--moe-routr: no such option", "--moe-router topp: not one of top, cosine, sigmoid"]
