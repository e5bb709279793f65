"""The engine's kernels from a native library built ahead of time, called without numba.

:mod:`.aot` compiles the kernels a host's queries used (their signatures, recorded by
:mod:`.jit`) with numba, once, into a shared library in the engine's ``__pycache__``
(``stretch-kernels-<key>.so`` and its manifest ``.json``). A process that finds the library for
its key loads it here with :mod:`ctypes` and calls the kernels' machine code directly; it
does not import numba, whose compiler and LLVM are about 90 MB of an engine's memory
(BENCHMARKS.md, aggregation state at scale). No numba import here.

The key covers what the machine code depends on: the engine's sources, the numba, llvmlite and
Python versions, and this CPU (its model and feature flags, as numba's code is compiled for the
host CPU). A library built elsewhere, or before a change, is not used.

Calls follow numba's own calling convention (``int status(ret*, excinfo**, args...)``, arrays
passed as their fields: meminfo, parent, size, itemsize, data, shape, strides). The library's
entry for each kernel takes those fields as 64-bit slots of one buffer, so a call is one
:mod:`ctypes` call, which releases the GIL as numba's ``nogil`` does. Arrays are borrowed (no
meminfo): the kernels never keep them. A kernel's exception (status 1) is raised here with
its message.

Examples
--------
>>> from pathlib import Path
>>> import spark_stretch.engine as engine
>>> from spark_stretch.engine.native import library_key
>>> len(library_key(Path(engine.__file__).parent))
16
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import pickle
import platform
import struct
import sys
from array import array
from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["Library", "load", "cache_dir", "library_key", "library_path", "sources_hash"]

_LIB = "stretch-kernels-{}.so"


def _version_of(pkg: str) -> str:
    """A package's version from its dist-info directory name (no import of it)."""
    import importlib.util

    spec = importlib.util.find_spec(pkg)
    if spec is None or spec.origin is None:
        return ""
    site = Path(spec.origin).parent.parent
    return ",".join(sorted(p.name for p in site.glob(f"{pkg}-*.dist-info")))


def _cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    seen = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        k = k.strip()
        if k in ("model name", "flags", "Features", "CPU part") and k not in seen:
            seen[k] = v.strip()
    return repr(sorted(seen.items()))


def sources_hash(pkg: Path) -> str:
    """A hash of every source file of the package ``pkg`` (also numba's cache's stamp,
    :mod:`.jitcache`)."""
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(pkg.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def library_key(pkg: Path) -> str:
    """The key of the kernels' library for the engine package ``pkg`` on this machine."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((sources_hash(pkg), _version_of("numba"), _version_of("llvmlite"),
                   sys.version, platform.machine(), _cpu())).encode())
    return h.hexdigest()


def cache_dir(pkg: Path) -> Path:
    """Where the kernels' library and the signatures it is built from are kept:
    ``$SPARK_STRETCH_AOT_DIR``, else the package's ``__pycache__`` (as numba's cache), else,
    where that cannot be written (a read-only install), ``~/.cache/spark_stretch``."""
    if os.environ.get("SPARK_STRETCH_AOT_DIR"):
        return Path(os.environ["SPARK_STRETCH_AOT_DIR"])
    own = pkg / "__pycache__"
    if os.access(own if own.exists() else pkg, os.W_OK):
        return own
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spark_stretch"


def library_path(pkg: Path, key: Optional[str] = None) -> Path:
    """Where the kernels' library for ``pkg`` (and this machine) is kept."""
    return cache_dir(pkg) / _LIB.format(key or library_key(pkg))


def _extension(name: str, rel: str):
    """One of numba's C extension modules, loaded from its file without importing numba."""
    import importlib.machinery
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("numba")
    if spec is None:
        raise ImportError("numba is not installed")
    root = Path(spec.origin).parent
    (path,) = root.glob(rel)
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path,
                                                                                loader=loader))
    loader.exec_module(mod)
    sys.modules[name] = mod  # (numba, if imported later, finds this one: one runtime)
    return mod


def _externals() -> dict:
    """Addresses of the C functions numba's code calls (its runtime and helpers)."""
    nrt = _extension("numba.core.runtime._nrt_python", "core/runtime/_nrt_python*.so")
    out = {(k if k.startswith("_") else f"NRT_{k}"): v for k, v in nrt.c_helpers.items()}
    helper = _extension("numba._helperlib", "_helperlib*.so")
    out.update({f"numba_{k}": v for k, v in helper.c_helpers.items()})
    return out


class Entry:
    """One kernel signature in the library: packs a call's arguments and calls it."""

    __slots__ = ("name", "fn", "args", "ret")

    def __init__(self, name: str, fn, args: list, ret: str):
        self.name, self.fn, self.args, self.ret = name, fn, args, ret

    def pack(self, values) -> Optional[array]:
        """``values`` as this entry's slots, or None if their types are not the ones it was
        compiled for (an array compiled read-only takes a writable one: the code only reads
        it)."""
        if len(values) != len(self.args):
            return None
        slots = array("q")
        for t, v in zip(self.args, values):
            if not _pack(t, v, slots):
                return None
        return slots

    def __call__(self, slots: array):
        ret = (ctypes.c_int64 * 4)()
        exc = ctypes.c_void_p()
        status = self.fn(slots.buffer_info()[0], ctypes.addressof(ret), ctypes.byref(exc))
        if status not in (0, -2):  # (-2: returned None)
            raise _exception(self.name, status, exc.value)
        if self.ret == "none":
            return None
        if self.ret == "int64":
            return ret[0]
        if self.ret == "float64":
            return struct.unpack("d", struct.pack("q", ret[0]))[0]
        if self.ret == "bool":
            return bool(ret[0] & 0xFF)
        n = int(self.ret.split(":")[1])  # "int64s:N", a tuple of N int64
        return tuple(ret[:n])


# numba's types of Python's own numbers (a numpy scalar is typed by its dtype)
_PY_SCALARS = {bool: "?", int: np.dtype(np.int64).char, float: "d"}


def _pack(t, v, slots: array) -> bool:
    """Append ``v``'s slots for type ``t``; False if ``v`` is not of type ``t``."""
    kind = t[0]
    if kind == "array":
        if type(v) is not np.ndarray or v.dtype.char != t[1] or v.ndim != t[2]:
            return False
        f = v.flags
        if not (f.c_contiguous and f.aligned and (t[3] or f.writeable)):
            return False
        slots.extend((0, 0, v.size, v.itemsize, v.__array_interface__["data"][0]))
        slots.extend(v.shape)
        slots.extend(v.strides)
        return True
    if kind == "tuple":
        return isinstance(v, tuple) and len(v) == len(t[1]) and all(
            _pack(a, b, slots) for a, b in zip(t[1], v))
    char = v.dtype.char if isinstance(v, np.generic) else _PY_SCALARS.get(type(v))
    if char != t[1]:
        return False
    if char in "fd":  # (a float's bits; a float32 in the low half)
        slots.append(int(np.array(v, char).view("i4" if char == "f" else "i8")))
    elif char in "QLP":  # (an unsigned 64-bit integer's two's complement)
        slots.append(int(np.array(v, char).view("i8")))
    else:  # (the entry truncates narrower integers)
        slots.append(int(v))
    return True


def _exception(name: str, status: int, info: Optional[int]) -> Exception:
    """The exception a kernel raised: numba's excinfo holds it pickled (class, args, where)."""
    msg = f"kernel {name} failed (status {status})"
    if status == 1 and info:
        try:
            data = ctypes.c_void_p.from_address(info).value
            size = ctypes.c_int32.from_address(info + 8).value
            cls, args = pickle.loads(ctypes.string_at(data, size))[:2]
            if isinstance(cls, type) and issubclass(cls, Exception):
                return cls(*args)
        except Exception:
            pass
    return RuntimeError(msg)


class Library:
    """The kernels' library of one key: ``entries[kernel name]`` is a list of :class:`Entry`."""

    def __init__(self, path: Path):
        manifest = json.loads(path.with_suffix(".json").read_text())
        self.path = path
        self._dll = ctypes.CDLL(str(path))
        if manifest["externals"]:
            addr = _externals()
            for name in manifest["externals"]:
                ctypes.c_void_p.in_dll(self._dll, f"stretch_addr_{name}").value = addr[name]
        self.entries: dict = {}
        for e in manifest["entries"]:
            fn = getattr(self._dll, e["symbol"])
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int32
            self.entries.setdefault(e["kernel"], []).append(
                Entry(e["kernel"], fn, e["args"], e["ret"]))


def load(pkg: Path) -> Optional[Library]:
    """The kernels' library for ``pkg`` on this machine, or None: none built for this key,
    ``SPARK_STRETCH_AOT=0``, or it does not load (then numba compiles, as without it)."""
    if os.environ.get("SPARK_STRETCH_AOT", "1") == "0":
        return None
    try:
        path = library_path(pkg)
        if not path.exists():
            return None
        return Library(path)
    except Exception as e:  # (a damaged or foreign file: numba's way)
        print(f"spark_stretch: the engine's kernel library did not load ({type(e).__name__}: "
              f"{e}); numba compiles the kernels", file=sys.stderr)
        return None
