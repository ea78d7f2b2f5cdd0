"""docs/hooks.md and docs/options.md are generated from ``HOOKS`` and the option definitions, and the
committed copies are what the generator writes today."""

import pytest

from fairseq_moe_ext.fairseq_integration import HOOKS, reference_docs


def test_the_committed_hook_and_option_references_are_what_the_tables_generate_today(capsys):
    assert reference_docs.main(["--check"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("damage", ["missing", "edited"])
def test_check_exits_1_naming_the_stale_reference_file_and_the_command_that_rewrites_it(tmp_path, capsys, damage):
    assert reference_docs.main(["--root", str(tmp_path)]) == 0
    assert reference_docs.main(["--root", str(tmp_path), "--check"]) == 0
    options = tmp_path / "docs" / "options.md"
    if damage == "missing":
        options.unlink()
    else:
        options.write_text(options.read_text().replace("--moe-top-k", "--moe-top-n"))
    assert reference_docs.main(["--root", str(tmp_path), "--check"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"docs/options.md is stale (it differs from the tables it is generated from): run {reference_docs.COMMAND}"
    )


def test_every_hook_and_every_registered_moe_option_has_its_row_in_the_references():
    hooks, options = reference_docs.hooks_markdown(), reference_docs.options_markdown()
    assert all(f"| {hook.number} | `{hook.target}` |" in hooks for hook in HOOKS)
    from fairseq_moe_ext.criterions.moe_criterions import MoELossConfig
    from fairseq_moe_ext.models.moe_config import MoEEncoderDecoderConfig

    names = [
        n for config in (MoEEncoderDecoderConfig, MoELossConfig) for n in config.__dataclass_fields__ if "moe" in n
    ]
    assert all(f"| `--{name.replace('_', '-')}` |" in options for name in names + ["moe_inference_experts"])
