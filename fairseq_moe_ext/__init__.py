"""fairseq-moe-ext: Mixture-of-Experts for stock fairseq, loaded with ``--user-dir``.

Tiers, lowest first; a module imports only from its own tier and the ones below
(``tests/repo/test_package_tiers.py`` scans every import):

0. ``common/``: helpers of every tier and no one subject, torch only: ``config_value.py`` (the one
   reader of a config value), ``torch_compat.py`` (the private torch APIs of data parallelism).
1. ``moe/``: the MoE math, torch only (router, dispatch, experts, collectives taking ``group=None``,
   the expert layout, which layers are MoE layers).
2. ``options/``: every ``--moe-*`` option as one record, from which the tables that name options are
   derived, and ``ranges.py`` (a numeric option checked against its record's range). Torch only.
3. ``checkpoint/``: per-rank checkpoint sets, torch only; imports the tiers below and itself. Its
   ``__main__`` (an alias of ``fairseq-moe``) reaches up once, lazily, for the registry of subcommands
   (``console.py``, at the top beside this file), which imports a subcommand's module only to run it.
4. ``parallel/``: the distributed glue: ``process_state.py`` (the plugin's state, one object),
   ``plan.py`` (``ParallelPlan``: W, P, the backend and the groups of a model), ``expert_grads.py`` and
   ``grad_norm.py`` (gradient scaling, the gradient norm), ``fully_sharded.py`` and ``expert_sharding.py``
   (FSDP2: the shared part, experts over their replica group), ``io_waits.py`` (where workers wait for
   another's file work). Fairseq may appear here, models do not.
5. ``models/``, ``criterions/`` and ``tasks/``: the fairseq architectures, criterions and tasks.
6. ``training/``: what fairseq-train decides around the model (save dir, restore choice, set ids,
   resume policy, upcycling).
7. ``fairseq_integration/``: the hook table and its adapters; importing it installs the hooks.

Installing into fairseq (registering the architectures and criterions, patching what
``fairseq_integration.HOOKS`` lists) happens only where fairseq is what is running: at import if
fairseq is already loaded (``--user-dir`` imports this package after fairseq), else as soon as
fairseq's own import finishes later, or, where a module of this package was mid-import then, at the
next import after it (fairseq's ``--user-dir`` import skips a package it finds imported already, so
a process that imported ``moe/`` first still gets the hooks).
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
    from . import criterions, fairseq_integration, models, tasks  # noqa: F401  (importing registers)

    fairseq_integration.install()


class _InstallOnceFairseqLoads(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Installs once fairseq is loaded: right after fairseq's own import finishes, or, where a module
    of this package was in the middle of importing (one that imports fairseq must finish before the
    hooks can import it), at the next import after that. Then it leaves ``sys.meta_path``."""

    def __init__(self):
        self._imported_by_install = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "fairseq" and "fairseq" not in sys.modules:
            return self._fairseq_spec(path, target)
        if "fairseq" not in sys.modules or _half_imported(include_fairseq=True):
            return None
        self._install()
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

    def _fairseq_spec(self, path, target):
        """fairseq's own spec, its loader wrapped so that the install follows fairseq's import."""
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)("fairseq", path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader

        class InstallAfter(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(inner, module):
                module.__loader__ = module.__spec__.loader = loader
                loader.exec_module(module)
                if not _half_imported(include_fairseq=False):
                    self._install()

        spec.loader = InstallAfter()
        return spec

    def _install(self):
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        install_into_fairseq()


def _initializing(module) -> bool:
    # importlib marks a module's spec ``_initializing`` while its body runs (CPython since 3.4).
    return getattr(getattr(module, "__spec__", None), "_initializing", False)


def _half_imported(include_fairseq: bool) -> bool:
    # Asked at every import while fairseq's own import runs: fairseq's module first, then the scan of
    # sys.modules (thousands of names) by a prefix test, which costs far less than splitting each name.
    if include_fairseq and _initializing(sys.modules.get("fairseq")):
        return True
    tops = ("fairseq", __name__) if include_fairseq else (__name__,)
    prefixes = tuple(top + "." for top in tops)
    return any(
        _initializing(module) for name, module in list(sys.modules.items()) if name in tops or name.startswith(prefixes)
    )


if "fairseq" in sys.modules:
    install_into_fairseq()
else:
    sys.meta_path.insert(0, _InstallOnceFairseqLoads())
