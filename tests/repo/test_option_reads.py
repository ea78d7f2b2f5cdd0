"""Every option is read one way: ``moe_options(cfg).<name>``, its record's parsed, typed value with the record's
default (fairseq_moe_ext/options/). Outside the options package no module reads an option by a string it spells
(``config_value(args, "moe_freeze", None)``, ``getattr(cfg, "moe_router", "top")``), which would bypass the
record's parser and write a second default at the read site. Readers of another project's files whose fields
share our names say so by their name (``branch_value``, ``hf_value``)."""

import ast
from pathlib import Path

import fairseq_moe_ext
from fairseq_moe_ext.options import OPTIONS, moe_options

PACKAGE = Path(fairseq_moe_ext.PACKAGE_DIR)
# Calls through which a config value is read by its name.
READERS = {"config_value", "getattr", "safe_getattr", "option_value", "moe_option", "get", "_get", "hasattr"}


def string_reads(source: str, names) -> list:
    """(line, reader, option name) for every call of a reader that passes an option's name as a string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        reader = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if reader not in READERS:
            continue
        found += [
            (node.lineno, reader, arg.value)
            for arg in node.args
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value in names
        ]
    return found


def test_no_module_outside_the_options_package_reads_an_option_by_its_name_as_a_string():
    modules = [p for p in PACKAGE.rglob("*.py") if "options" not in p.relative_to(PACKAGE).parts]
    assert len(modules) > 100, "few modules found: the check would pass on nothing"
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {reader}(..., {name!r}): read moe_options(cfg).{name}"
        for path in modules
        for line, reader, name in string_reads(path.read_text(), set(OPTIONS))
    ]
    assert not offenders, "\n".join(offenders)


def test_the_check_sees_a_string_read_with_a_literal_default_and_passes_the_one_read_path():
    source = (
        "a = config_value(args, 'moe_freeze', None)\n"
        "b = getattr(cfg, 'moe_router', 'top')\n"
        "c = moe_options(args).moe_freeze\n"
        "d = config_value(args, 'seed')\n"  # fairseq's own option: not ours to record
        "e = cfg.get('moe_top_k', 2)\n"
    )
    assert string_reads(source, set(OPTIONS)) == [
        (1, "config_value", "moe_freeze"),
        (2, "getattr", "moe_router"),
        (5, "get", "moe_top_k"),
    ]


def test_one_read_gives_each_option_parsed_and_typed_with_its_records_default():
    import argparse

    values = moe_options(argparse.Namespace(moe_freeze="experts,router", moe_router="sigmoid"))
    assert values.moe_freeze == frozenset({"router", "experts"})
    assert values.moe_router == "sigmoid" and type(values.moe_router).__name__ == "MoeRouter"
    assert values.moe_expert_count == OPTIONS["moe_expert_count"].default
    assert moe_options(argparse.Namespace(), as_saved=True).moe_expert_count is None
    try:
        values.moe_frezee
    except AttributeError as e:
        assert "no option record is named 'moe_frezee'" in str(e)
    else:
        raise AssertionError("a misspelt option must not read as None")
