# Sourced by the quickstart commands: creates (or reuses) ./.venv with the pinned stack and this
# package installed in editable mode, then activates it.
#
# Why ve-fairseq: upstream fairseq==0.12.2 does not import on Python 3.11 (dataclass mutable
# defaults). ve-fairseq==0.12.3 is a prebuilt cp311 wheel of the same 0.12.3 sources (about 2 min
# to install); fairseq-fixed==0.12.3.1 is an sdist that compiles for ~15 min. Set
# FAIRSEQ_SPEC=fairseq-fixed==0.12.3.1 to use the latter.
set -e
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${MOE_VENV:-$repo_root/.venv}
stamp=$venv/.moe-ext-installed
setup_stamp=$venv/.moe-ext-setup.py  # setup.py as the editable install last read it
requirements=$repo_root/requirements.txt
# Test-only pins (the transformers oracle): installed here, never by setup.py.
test_requirements=$repo_root/tests/requirements-oracle.txt
# fairscale, the FSDP shard oracle, goes beside site-packages (see the file): fairseq must not find it.
fairscale_requirements=$repo_root/tests/requirements-fairscale.txt
# transformers' NLLB-MoE converter (the script that wrote the hub's copy): one file out of an older wheel (see it).
converter_requirements=$repo_root/tests/requirements-converter.txt
# The stamp holds these files as installed: editing any one reinstalls.
wanted=$(cat "$requirements" "$test_requirements" "$fairscale_requirements" "$converter_requirements")
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
  echo "[venv] installing pinned dependencies into $venv (first use only)" >&2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements" -r "$test_requirements" \
      ${FAIRSEQ_SPEC:+"$FAIRSEQ_SPEC"} 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  "$venv/bin/python" -m pip uninstall -q -y fairscale >/dev/null 2>&1 || true  # an older venv had it in site-packages
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --upgrade \
      --target "$venv/oracles/fairscale" -r "$fairscale_requirements" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  converter_wheel=$(mktemp -d)
  "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$converter_wheel" \
      -r "$converter_requirements" >&2 || true
  "$venv/bin/python" "$repo_root/recipes/lib/wheel_member.py" "$converter_wheel" \
      transformers/models/nllb_moe/convert_nllb_moe_sharded_original_checkpoint_to_pytorch.py \
      "$venv/oracles/nllb_moe_converter" >&2 || true
  rm -rf "$converter_wheel"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$repo_root" \
      2>&1 | grep -v "is ignored: it is neither" >&2 || true
  "$venv/bin/python" -c "import fairseq, torch, fairseq_moe_ext" >/dev/null
  printf '%s\n' "$wanted" > "$stamp"
  cp "$repo_root/setup.py" "$setup_stamp"
fi
# A venv shared between checkouts (MOE_VENV, git worktrees) imports the package from the checkout that last
# installed it, which may since have been deleted: point the editable install at this one (run from / so that
# the current directory cannot answer the import). The install's console script (fairseq-moe) comes from
# setup.py as it was then: a changed setup.py reinstalls too.
installed=$(cd / && "$venv/bin/python" -c "import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec('fairseq_moe_ext').origin)))" 2>/dev/null || true)
if [ "$installed" != "$repo_root" ] || ! cmp -s "$repo_root/setup.py" "$setup_stamp"; then
  changed=$(cmp -s "$repo_root/setup.py" "$setup_stamp" || echo "; setup.py changed since")
  echo "[venv] pointing the editable install of fairseq_moe_ext at $repo_root (it was: ${installed:-not importable}$changed)" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$repo_root" \
      2>&1 | grep -v "is ignored: it is neither" >&2 || true
  cp "$repo_root/setup.py" "$setup_stamp"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
