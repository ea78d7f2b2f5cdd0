"""fairseq-moe-ext: Mixture-of-Experts for stock fairseq, loaded with ``--user-dir``.

Tiers, lowest first; a module imports only from its own tier and the ones below
(``tests/test_package_tiers.py`` scans every import):

1. ``moe/``: the MoE math, torch only (router, dispatch, experts, collectives taking ``group=None``,
   the expert layout, which layers are MoE layers).
2. ``checkpoint/``: per-rank checkpoint sets, torch only; imports ``moe/`` and itself. Its
   ``__main__`` reaches up once, lazily, for the ``upcycle`` subcommand (``training/upcycle_cli.py``).
3. distributed glue: ``process_state.py`` (the plugin's state, one object), ``distributed.py`` (expert
   groups, gradient scaling), ``io_waits.py`` (where workers wait for another's file work),
   ``option_ranges.py`` (every numeric option's range). Fairseq may appear here, models do not.
4. ``models/`` and ``criterions/``: the fairseq architectures and criterions.
5. ``training/``: what fairseq-train decides around the model (save dir, restore choice, set ids,
   resume policy, upcycling).
6. ``fairseq_integration/``: the hook table and its adapters; importing it installs the hooks.

Installing into fairseq (registering the architectures and criterions, patching what
``fairseq_integration.HOOKS`` lists) happens only where fairseq is what is running: at import if
fairseq is already loaded (``--user-dir`` imports this package after fairseq), else as soon as
fairseq is loaded later, at the first import after it that no module of this package is in the
middle of (fairseq's ``--user-dir`` import skips a package it finds imported already).
``install_into_fairseq()`` does it explicitly. Importing ``fairseq_moe_ext.moe`` or
``fairseq_moe_ext.checkpoint`` alone imports nothing of fairseq's.
"""

import importlib.abc
import importlib.util
import os
import sys

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def install_into_fairseq() -> None:
    """Register the MoE architectures and criterions with fairseq and install the hooks (again: no-op)."""
    from . import criterions, fairseq_integration, models  # noqa: F401  (importing registers)

    fairseq_integration.install()


class _InstallOnceFairseqLoads(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Sees every import that reaches ``sys.meta_path``. At the first one after fairseq is loaded that
    no module of fairseq's or of this package is in the middle of (one that imported fairseq must
    finish before the hooks can import it), it installs and leaves ``sys.meta_path``."""

    def __init__(self):
        self._imported_by_install = {}

    def find_spec(self, fullname, path=None, target=None):
        if "fairseq" not in sys.modules or _half_imported():
            return None
        sys.meta_path.remove(self)
        install_into_fairseq()
        if fullname not in sys.modules:
            return None
        # The install imported ``fullname`` itself. importlib, finding it in sys.modules after a finder
        # answered, would execute it a second time; this loader hands over the module already loaded.
        module = sys.modules.pop(fullname)
        self._imported_by_install[fullname] = (module, module.__spec__)
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return self._imported_by_install[spec.name][0]

    def exec_module(self, module):
        # importlib set ``__spec__`` to this loader's spec; give the module back its own.
        module.__spec__ = self._imported_by_install.pop(module.__name__)[1]


def _half_imported() -> bool:
    # importlib marks a module's spec ``_initializing`` while its body runs (CPython since 3.4).
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items())
               if name.split(".")[0] in ("fairseq", "fairseq_cli", __name__))


if "fairseq" in sys.modules:
    install_into_fairseq()
else:
    sys.meta_path.insert(0, _InstallOnceFairseqLoads())
