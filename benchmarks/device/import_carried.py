#!/usr/bin/env python
"""On a CPython 3.12 with no torch: the carried wheels, installed with --target into SITE, import.

    PYTHONPATH=SITE:MACHINE python3.12 -s benchmarks/device/import_carried.py SITE

What needs no torch is imported and used: hydra, omegaconf (an interpolation, which runs the
antlr4 grammar), bitarray, and fairseq's compiled Cython modules (loaded from their files, past
fairseq/__init__.py, which imports torch) when a numpy is on the path. Every Python file of the set
and of this tree's benchmarks/ and fairseq_moe_ext/ is compiled by this interpreter (syntax).
Exit 1 with one line per failure.
"""

import importlib.machinery
import importlib.util
import py_compile
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_extension(path: Path):
    name = path.name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def checks(site: Path):
    import antlr4
    import bitarray
    import hydra
    from omegaconf import OmegaConf

    yield f"hydra {hydra.__version__}, antlr4 runtime {antlr4.__name__} imported"
    config = OmegaConf.create({"a": "${b}", "b": 3})
    assert config.a == 3, config
    yield "omegaconf interpolation (antlr4 grammar) resolves"
    bits = bitarray.bitarray("1011")
    assert bits.count() == 3
    yield f"bitarray {bitarray.__version__} works"
    try:
        import numpy
    except ImportError:
        yield "SKIP fairseq's compiled modules: no numpy on the path"
    else:
        loaded, need_torch = [], []
        for name in ("data_utils_fast", "token_block_utils_fast"):
            found = sorted((site / "fairseq" / "data").glob(f"{name}.cpython-312-*.so"))
            assert found, f"fairseq/data/{name}.cpython-312-*.so missing from the set"
            try:
                load_extension(found[0])
                loaded.append(name)
            except ModuleNotFoundError as error:
                if error.name != "torch":
                    raise
                need_torch.append(name)
        yield (
            f"fairseq's compiled {', '.join(loaded)} loads against numpy {numpy.__version__}"
            + (f"; {', '.join(need_torch)} imports torch (loaded on the GPU machine only)" if need_torch else "")
        )
    sources = list(site.rglob("*.py")) + list((ROOT / "benchmarks").rglob("*.py"))
    sources += list((ROOT / "fairseq_moe_ext").rglob("*.py"))
    warnings.simplefilter("ignore", SyntaxWarning)  # old escapes in fairseq: warnings, as on the machine
    with tempfile.TemporaryDirectory() as scratch:
        for i, source in enumerate(sources):
            py_compile.compile(str(source), cfile=f"{scratch}/{i}.pyc", doraise=True)
    yield f"{len(sources)} Python files of the set and the tree compile"


def main() -> int:
    if sys.version_info[:2] != (3, 12):
        print(f"import_carried: run me with CPython 3.12, not {sys.version.split()[0]}", file=sys.stderr)
        return 1
    site = Path(sys.argv[1])
    try:
        for line in checks(site):
            print(f"  {line}")
    except Exception as error:  # noqa: BLE001 - reported, one line
        print(f"import_carried: FAILED: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
