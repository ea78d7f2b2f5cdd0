"""Checkpoints pickled as under numpy 1.x: numpy objects named ``numpy.core.multiarray.*``, as numpy 1.x
pickles them (numpy 2 names the same objects ``numpy._core.multiarray.*``). A fairseq checkpoint saved before
numpy 2 holds such names wherever it holds a numpy object (``--eval-bleu``'s counters, a numpy scalar in
``extra_state`` or the meters; fairseq issue #5603 shows them in an ordinary checkpoint).

Provenance. numpy 2 cannot write those names, so ``Numpy1Pickler`` writes them: Python's own pickler with one
change, the module it names for numpy 2's ``scalar`` and ``_reconstruct`` (``save_global``); numpy's own
``__reduce__`` gives everything else. ``NUMPY_1_26_4_BYTES`` are what numpy 1.26.4 itself wrote,
``pickle.dumps(obj, protocol=2)`` (torch.save's protocol) in a scratch venv holding numpy 1.26.4 alone
(Python 3.11, 7 Dec 2026), recorded here as hex; ``tests/checkpoint/test_numpy1_pickles.py`` checks that this
pickler writes those very bytes and, with ``pickletools``, that they name ``numpy.core.multiarray``. torch.save
takes the pickler through its documented ``pickle_module`` argument, in its zip format or in the legacy
(pre-1.6) one (``_use_new_zipfile_serialization=False``: torch's own writer of that format).
"""

import pickle
import pickletools
import types
from typing import List

import numpy
import torch

_MULTIARRAY = getattr(numpy, "_core", None) or numpy.core
# numpy 2's objects, and the module numpy 1.x names them by
NUMPY_1_MODULE = {
    _MULTIARRAY.multiarray.scalar: "numpy.core.multiarray",
    _MULTIARRAY.multiarray._reconstruct: "numpy.core.multiarray",
}

# fmt: off
# pickle.dumps(obj, protocol=2) under numpy 1.26.4 (see the module's docstring)
NUMPY_1_26_4_BYTES = {
    "numpy.float64(2.5)": "8002636e756d70792e636f72652e6d756c746961727261790a7363616c61720a7100636e756d70790a64747970650a"
                          "71015802000000663871028988877103527104284b0358010000003c71054e4e4e4affffffff4affffffff4b0074"
                          "710662635f636f646563730a656e636f64650a710758080000000000000000000440710858060000006c617469"
                          "6e31710986710a52710b86710c52710d2e",
    "numpy.int64(7)": "8002636e756d70792e636f72652e6d756c746961727261790a7363616c61720a7100636e756d70790a64747970650a71"
                      "015802000000693871028988877103527104284b0358010000003c71054e4e4e4affffffff4affffffff4b00747106"
                      "62635f636f646563730a656e636f64650a710758080000000700000000000000710858060000006c6174696e3171"
                      "0986710a52710b86710c52710d2e",
    "numpy.array([1.5, 2.0])": "8002636e756d70792e636f72652e6d756c746961727261790a5f7265636f6e7374727563740a7100636e756d"
                               "70790a6e6461727261790a71014b00857102635f636f646563730a656e636f64650a710358010000006271"
                               "0458060000006c6174696e317105867106527107877108527109284b014b0285710a636e756d70790a6474"
                               "7970650a710b58020000006638710c898887710d52710e284b0358010000003c710f4e4e4e4affffffff4a"
                               "ffffffff4b00747110628968035811000000000000000000c3b83f000000000000004071116805867112"
                               "527113747114622e",
}
# fmt: on
OBJECTS = {
    "numpy.float64(2.5)": numpy.float64(2.5),
    "numpy.int64(7)": numpy.int64(7),
    "numpy.array([1.5, 2.0])": numpy.array([1.5, 2.0]),
}


class Numpy1Pickler(pickle._Pickler):
    """Python's pickler, naming numpy 2's ``scalar`` and ``_reconstruct`` as numpy 1.x does."""

    def save_global(self, obj, name=None):
        module = NUMPY_1_MODULE.get(obj) if isinstance(obj, types.BuiltinFunctionType) else None
        if module is None:
            return super().save_global(obj, name)
        assert self.proto < 4, "numpy 1.x's names are written for torch.save's protocol 2"
        self.write(pickle.GLOBAL + f"{module}\n{obj.__name__}\n".encode())
        self.memoize(obj)


def _dump(obj, file, protocol=2):
    Numpy1Pickler(file, protocol=protocol).dump(obj)


# torch.save(..., pickle_module=NUMPY_1_PICKLE): torch.save uses the module's Pickler (the legacy format its dump)
NUMPY_1_PICKLE = types.ModuleType("numpy1_pickle")
NUMPY_1_PICKLE.Pickler, NUMPY_1_PICKLE.dump = Numpy1Pickler, _dump


def numpy1_dumps(obj, protocol: int = 2) -> bytes:
    import io

    buffer = io.BytesIO()
    _dump(obj, buffer, protocol)
    return buffer.getvalue()


def pickled_globals(data: bytes) -> List[str]:
    """Every global a pickle names (``module.name``), read with pickletools."""
    found = []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL":
            found.append(arg.replace(" ", "."))
        elif opcode.name == "STACK_GLOBAL":
            raise AssertionError("protocol 4 pickles name globals by the stack: not numpy 1.x's protocol-2 form")
    return found


def save_numpy1(state, path, legacy: bool = False) -> None:
    """``torch.save(state, path)`` with numpy objects named as numpy 1.x names them; ``legacy``: torch's
    pre-1.6 (non-zip) format, as fairseq's older released models ship."""
    torch.save(state, path, pickle_module=NUMPY_1_PICKLE, _use_new_zipfile_serialization=not legacy)


def data_pickle(path) -> bytes:
    """The pickle of a torch.save zip file (``<root>/data.pkl``)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        return archive.read(name)
