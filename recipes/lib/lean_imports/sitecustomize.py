"""The suite's subprocesses (tests/support's fairseq_helpers.fairseq_env puts this folder on PYTHONPATH)
and the GPU one-shot's CPU dry run (benchmarks/gpu_oneshot.sh): scikit-learn and scipy.stats are imported
when first used, not at start-up. Nothing else runs with it.

fairseq 0.12 imports every criterion and task when it is imported; two of them that this plugin
never uses (sentence_prediction's metrics, audio_classification) import scikit-learn, which
imports scipy.stats: about a quarter of the CPU time of starting any fairseq process, paid by
every worker of every test run. Here those names stand for deferred stand-ins: a name imported
from them (``from sklearn.metrics import f1_score``) is a function that, when called, imports the
real module and calls the real function. Nothing of a test's run differs unless it calls one of
them, and then it gets the real one.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

DEFERRED = ("sklearn", "scipy.stats")


def _deferred(name: str) -> bool:
    return any(name == d or name.startswith(d + ".") for d in DEFERRED)


def _real(name: str):
    """Import the real module ``name`` in place of its stand-ins and return it."""
    stand_in = sys.modules.get(name)
    if not isinstance(stand_in, _StandIn):
        return importlib.import_module(name)
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for key in [k for k, v in sys.modules.items() if isinstance(v, _StandIn)]:
        del sys.modules[key]
    return importlib.import_module(name)


class _StandIn(types.ModuleType):
    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        module = self.__name__

        def call(*args, **kwargs):
            return getattr(_real(module), attribute)(*args, **kwargs)

        call.__name__ = call.__qualname__ = attribute
        return call


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if not _deferred(name):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        module.__path__ = []


_FINDER = _Finder()
sys.meta_path.insert(0, _FINDER)
