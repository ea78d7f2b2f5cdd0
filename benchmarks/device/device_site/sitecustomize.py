"""This machine's Python, narrowed to what the lent GPU machine will have: its own packages
(../device_packages.txt) and the carried wheels (../wheels.txt and this project). With this folder on
PYTHONPATH, importing a top-level module that belongs to any other installed distribution fails as
it would there (``ModuleNotFoundError``), in this process and in every child that inherits the path.
The CPU dry run of the one-shot runs under it, so a dependency the device lacks fails here first.

``DEVICE_SITE_MISSING=a,b`` refuses more distributions (the brief says pytest is absent there, though
the machine's list names it); ``DEVICE_SITE_LOG=file`` appends each refused import, one line each
(guarded optional imports are refused too: the log tells them apart from failures). A
``sitecustomize`` further along the path (recipes/lib/lean_imports) still runs after this one.
"""

import importlib.abc
import importlib.util
import os
import re
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_DEVICE = os.path.dirname(_HERE)


def _normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(path):
    with open(path) as f:
        lines = (line.split("#", 1)[0].split() for line in f)
        return {_normalize(words[0].partition("==")[0]) for words in lines if words}


class DeviceOnlyImports(importlib.abc.MetaPathFinder):
    def __init__(self, allowed, refused):
        self.allowed, self.refused = allowed, refused
        self.owners = None  # top-level module name -> distributions, read on first use
        self.cleared = set()

    def find_spec(self, name, path=None, target=None):
        if "." in name or name in self.cleared or name in sys.stdlib_module_names or name in sys.builtin_module_names:
            return None
        if self.owners is None:
            from importlib.metadata import packages_distributions

            self.owners = packages_distributions()
        owners = {_normalize(d) for d in self.owners.get(name, ())}
        if owners and not (owners & self.allowed) or owners & self.refused:
            where = os.environ.get("DEVICE_SITE_LOG")
            if where:
                with open(where, "a") as log:
                    log.write(f"{name} ({', '.join(sorted(owners))})\n")
            raise ModuleNotFoundError(
                f"No module named {name!r} on the emulated GPU machine: {', '.join(sorted(owners))} is neither "
                f"installed there nor carried (benchmarks/device/wheels.txt)", name=name)
        self.cleared.add(name)  # unowned names (this tree's modules) and allowed ones
        return None


def install():
    allowed = _names(os.path.join(_DEVICE, "device_packages.txt")) | _names(os.path.join(_DEVICE, "wheels.txt"))
    allowed.add("fairseq-moe-ext")
    refused = {_normalize(n) for n in os.environ.get("DEVICE_SITE_MISSING", "").split(",") if n.strip()}
    sys.meta_path.insert(0, DeviceOnlyImports(allowed - refused, refused))


def _run_next_sitecustomize():
    for entry in sys.path:
        candidate = os.path.join(entry or os.getcwd(), "sitecustomize.py")
        if os.path.abspath(entry or os.getcwd()) != _HERE and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


install()
_run_next_sitecustomize()
