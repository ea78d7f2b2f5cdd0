"""fairscale 0.4.13, the FSDP shard oracle, on ``sys.path`` only while an oracle test uses it.

recipes/lib/venv.sh installs it into ``<venv>/oracles/fairscale``, beside site-packages and not in it:
fairseq imports fairscale wherever it can and then takes other paths (its fully_sharded backend,
checkpoint_utils) and prints fairscale's warnings, and the suite tests the plugin on fairseq as users
install it (tests/requirements-fairscale.txt)."""

import importlib
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

ORACLE_DIR = Path(sys.prefix) / "oracles" / "fairscale"


@contextmanager
def fairscale_fsdp():
    """``fairscale.nn.data_parallel`` for the duration of the block; skips the test where it is not installed."""
    import fairseq  # noqa: F401  (fairseq decides its optional imports first, without fairscale, as users have it)

    if not (ORACLE_DIR / "fairscale").is_dir():
        pytest.skip(
            f"fairscale (tests/requirements-fairscale.txt) is not installed in {ORACLE_DIR}: bash tests/run.sh installs it"
        )
    sys.path.append(str(ORACLE_DIR))
    try:
        yield importlib.import_module("fairscale.nn.data_parallel")
    finally:
        sys.path.remove(str(ORACLE_DIR))
        for name in [m for m in sys.modules if m == "fairscale" or m.startswith("fairscale.")]:
            del sys.modules[name]
