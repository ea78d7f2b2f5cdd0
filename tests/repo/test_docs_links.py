"""The docs point at things that exist: links and their anchors, repository paths, test names.

README.md, CHANGELOG.md and docs/*.md cite files (`tests/test_x.py`, `fairseq_moe_ext/moe/router.py`)
and tests by function name as the evidence for a promise; a rename that leaves the docs behind
turns that evidence into a dead reference. These checks read the markdown only (no imports of the
package), so they run in well under a second.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$", re.M)
_REPO_PATH = re.compile(r"(?<![\w/.$-])((?:tests|fairseq_moe_ext|benchmarks|recipes)/[\w./-]*\w)")
_TEST_NAME = re.compile(r"(?<![\w/.])(test_\w+)(\.\.\.)?(?![\w.]*\.py)")
_CASE_ID = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)+")
_TEST_DEF = re.compile(r"^\s*(?:async\s+)?def\s+(test_\w+)\s*\(", re.M)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: inline markup dropped, lower case, every character that
    is not a letter, digit, '_', '-' or space removed, spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"[`*]|<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors_of(markdown: str) -> set:
    """Every anchor of a document, duplicates numbered '-1', '-2', ... as GitHub numbers them."""
    seen: dict = {}
    anchors = set()
    for _, text in _HEADING.findall(_FENCE.sub("", markdown)):
        slug = github_slug(text)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def prose_of(markdown: str) -> str:
    """The text outside fenced code blocks and code spans: where a markdown link is a link."""
    return _CODE_SPAN.sub(" ", _FENCE.sub("", markdown))


def broken_links(doc: Path, root: Path) -> list:
    """'doc: target (why)' for every relative link of doc whose file or anchor does not exist."""
    problems = []
    for target in _LINK.findall(prose_of(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:: not a repository file
            continue
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc.resolve()
        relative = dest.relative_to(root).as_posix() if dest.is_relative_to(root) else str(dest)
        if not dest.exists():
            problems.append(f"{doc.name}: {target} (no file {relative})")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors_of(dest.read_text()):
            problems.append(f"{doc.name}: {target} (no heading with anchor #{anchor} in {relative})")
    return problems


def missing_paths(doc: Path, root: Path) -> list:
    """'doc: path' for every tests/, fairseq_moe_ext/, benchmarks/ or recipes/ path doc names that
    is neither a file nor a directory of the repository."""
    found = set(_REPO_PATH.findall(doc.read_text()))
    return [f"{doc.name}: {p}" for p in sorted(found) if not (root / p).exists()]


def defined_test_names(tests_dir: Path) -> set:
    return {name for f in tests_dir.rglob("*.py") for name in _TEST_DEF.findall(f.read_text())}


def missing_test_names(doc: Path, defined: set) -> list:
    """'doc: name' for every test function doc cites that no `def` under tests/ defines; a name
    cut short with '...' (a long name abbreviated in a table) must be the start of one."""
    problems = []
    for name, cut_short in _TEST_NAME.findall(doc.read_text()):
        if cut_short:
            if not any(d.startswith(name) for d in defined):
                problems.append(f"{doc.name}: {name}...")
        elif name not in defined:
            problems.append(f"{doc.name}: {name}")
    return sorted(set(problems))


def cited_case_ids(markdown: str) -> list:
    """The bad-input case ids (`top-k-zero`) in the last column of every table headed '... | case |'."""
    ids, in_case_table = [], False
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            in_case_table = False
        elif cells[-1] == "case":
            in_case_table = True
        elif in_case_table:
            ids += [span for span in re.findall(r"`([^`]+)`", cells[-1]) if _CASE_ID.fullmatch(span)]
    return ids


def missing_case_ids(doc: Path, tests_dir: Path) -> list:
    """'doc: id' for every case id doc cites that no test file spells as a quoted string ("top-k-zero")."""
    sources = "\n".join(f.read_text() for f in tests_dir.rglob("*.py"))
    return [f"{doc.name}: {i}" for i in sorted(set(cited_case_ids(doc.read_text()))) if f'"{i}"' not in sources]


def test_the_docs_checked_are_the_readme_the_changelog_and_every_file_of_docs():
    names = {d.relative_to(ROOT).as_posix() for d in DOC_FILES}
    assert {"README.md", "CHANGELOG.md", "docs/reliability.md", "docs/troubleshooting.md"} <= names


def test_every_relative_link_in_the_docs_reaches_an_existing_file_and_heading():
    problems = [p for doc in DOC_FILES for p in broken_links(doc, ROOT)]
    assert not problems, "dead links:\n" + "\n".join(problems)


def test_every_tests_package_benchmark_and_recipe_path_named_in_the_docs_exists():
    problems = [p for doc in DOC_FILES for p in missing_paths(doc, ROOT)]
    assert not problems, "paths that do not exist:\n" + "\n".join(problems)


def test_every_test_function_the_docs_cite_as_evidence_is_defined_under_tests():
    defined = defined_test_names(ROOT / "tests")
    problems = [p for doc in DOC_FILES for p in missing_test_names(doc, defined)]
    assert not problems, "cited tests that no file defines:\n" + "\n".join(problems)


def test_every_bad_input_case_the_docs_cite_is_a_case_of_the_bad_input_tests():
    cited = [i for doc in DOC_FILES for i in cited_case_ids(doc.read_text())]
    assert len(cited) > 40, "the bad-input table was not found: the check would pass on nothing"
    problems = [p for doc in DOC_FILES for p in missing_case_ids(doc, ROOT / "tests")]
    assert not problems, "cited bad-input cases that no test defines:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "heading, slug",
    [
        ("Quickstart", "quickstart"),
        ("Reliability: what is guaranteed", "reliability-what-is-guaranteed"),
        ("The GPU one-shot (`benchmarks/gpu_oneshot.sh`)", "the-gpu-one-shot-benchmarksgpu_oneshotsh"),
        ("torch >= 2.6 and `weights_only`", "torch--26-and-weights_only"),
        ("Dead and stalled workers: the knobs", "dead-and-stalled-workers-the-knobs"),
        ("Sparse upcycling: a dense checkpoint becomes an MoE", "sparse-upcycling-a-dense-checkpoint-becomes-an-moe"),
        ("A [linked](x.md) **bold** heading", "a-linked-bold-heading"),
    ],
)
def test_heading_anchors_follow_githubs_slug_rule(heading, slug):
    assert github_slug(heading) == slug


def test_a_repeated_heading_gets_a_numbered_anchor_and_fenced_lines_are_no_headings():
    markdown = "# Notes\n\n## Notes\n\n```bash\n# not a heading\n```\n"
    assert anchors_of(markdown) == {"notes", "notes-1"}


# Each bad reference the checks exist for, in a throwaway repository: (doc text, what is reported).
# fmt: off
BAD_REFERENCES = [
    ("see [a](docs/nowhere.md)", broken_links, "docs/nowhere.md (no file docs/nowhere.md)"),
    ("see [a](docs/real.md#no-such-heading)", broken_links, "(no heading with anchor #no-such-heading"),
    ("see [a](#not-here)", broken_links, "#not-here (no heading with anchor #not-here"),
    ("tested by `tests/test_gone.py`", missing_paths, "tests/test_gone.py"),
    ("in `fairseq_moe_ext/moe/gone.py`", missing_paths, "fairseq_moe_ext/moe/gone.py"),
    ("backed by `test_a_promise_nobody_tests`", None, "test_a_promise_nobody_tests"),
    ("backed by `test_a_promise_nob...`", None, "test_a_promise_nob..."),
    ("| input | line | case |\n| --- | --- | --- |\n| x | y | `no-such-case` |", missing_case_ids, "no-such-case"),
]
# fmt: on


@pytest.mark.parametrize("text, check, reported", BAD_REFERENCES, ids=[r[2][:40] for r in BAD_REFERENCES])
def test_each_kind_of_dead_reference_is_reported_naming_the_doc_and_the_target(tmp_path, text, check, reported):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "real.md").write_text("# Real\n\n## A heading\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_a_promise_kept():\n    pass\n")
    doc = tmp_path / "README.md"
    doc.write_text(f"# Title\n\n{text}\n")
    if check is None:
        problems = missing_test_names(doc, defined_test_names(tmp_path / "tests"))
    elif check is missing_case_ids:
        problems = check(doc, tmp_path / "tests")
    else:
        problems = check(doc, tmp_path)
    assert len(problems) == 1 and problems[0].startswith("README.md: ") and reported in problems[0], problems


def test_good_references_links_anchors_and_code_spans_are_not_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "real.md").write_text("# Real\n\n## A heading\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text('def test_a_promise_kept():\n    pass\n# Case("a-case")\n')
    doc = tmp_path / "README.md"
    doc.write_text(
        "| input | case |\n| --- | --- |\n| x | `a-case`, `tests/test_x.py` |\n\n"
        "# Title\n\n[a](docs/real.md#a-heading) [b](#title) [c](https://example.org/x)\n"
        "`[f](nowhere.md)` in a code span\n"
        "`tests/test_x.py::test_a_promise_kept`, `test_a_promise...`, `tests/`\n"
    )
    assert broken_links(doc, tmp_path) == []
    assert missing_paths(doc, tmp_path) == []
    assert missing_test_names(doc, defined_test_names(tmp_path / "tests")) == []
    assert cited_case_ids(doc.read_text()) == ["a-case"] and missing_case_ids(doc, tmp_path / "tests") == []
