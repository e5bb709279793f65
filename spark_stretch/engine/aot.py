"""Build the engine's kernels ahead of time into a native library (loaded by :mod:`.native`).

The signatures are those numba compiled the kernels for on this machine, recorded by
:func:`.jit.record_signatures` (``python -m spark_stretch warm`` runs the query kinds and then
builds). For each kernel signature numba compiles the kernel afresh (a temporary cache, so its
LLVM IR is at hand); this module adds an entry function that takes the arguments as 64-bit
slots of one buffer and calls numba's function, keeps the entry alone visible (the Python
wrappers numba also makes, and what only they call, are dropped), emits position-independent
object code with llvmlite for this CPU, and links the objects with the system's C compiler
(``cc``) into ``stretch-kernels-<key>.so`` beside a JSON manifest of its entries. The C
functions numba's code calls (its runtime's allocator, exceptions' helpers) are reached through
pointers the loader sets from numba's own extension modules.

Nothing is built where there is no C compiler or llvmlite fails: the engine then uses numba as
before. The build runs in its own process (:func:`build`), so the caller imports no numba.

Run it::

    python -m spark_stretch.engine.aot        # after some queries ran (or `warm`)

Examples
--------
>>> from pathlib import Path
>>> import spark_stretch.engine as engine
>>> from spark_stretch.engine.aot import build
>>> build(Path(engine.__file__).parent).exists()   # doctest: +SKIP
True
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["build"]

_PKG = Path(__file__).parent


def build(pkg: Path = _PKG, timeout: float = 900) -> Path:
    """Build the kernels' library of ``pkg`` for this machine from the recorded signatures, in
    a subprocess; returns its path. Raises ``RuntimeError`` with the build's output if it
    fails (no C compiler, no signatures recorded, a compile error)."""
    from .native import library_path

    with tempfile.TemporaryDirectory(prefix="stretch-aot-") as tmp:
        env = dict(os.environ, SPARK_STRETCH_AOT="0", NUMBA_CACHE_DIR=tmp)
        r = subprocess.run([sys.executable, "-m", "spark_stretch.engine.aot", str(pkg)],
                           env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"building the engine's kernel library failed:\n{r.stderr[-4000:]}")
    return library_path(pkg)


# -- in the build's process (numba imported) ---------------------------------------------------

def _arg_spec(t) -> list:
    """A numba type as :mod:`.native` packs it: ("array", dtype char, ndim, readonly),
    ("tuple", [...]) or ("scalar", dtype char) of a number or boolean."""
    import numpy as np
    from numba.core import types

    if isinstance(t, types.Array):
        if t.layout != "C" or not t.aligned:
            raise TypeError(f"array layout {t.layout}")
        return ["array", np.dtype(str(t.dtype)).char, t.ndim, not t.mutable]
    if isinstance(t, types.BaseTuple):
        return ["tuple", [_arg_spec(x) for x in t.types]]
    if isinstance(t, (types.Integer, types.Boolean)) or t in (types.float64, types.float32):
        return ["scalar", np.dtype(str(t) if t != types.boolean else "bool").char]
    raise TypeError(f"argument type {t}")


def _ret_spec(t) -> str:
    from numba.core import types

    if t == types.none:
        return "none"
    if t in (types.int64, types.float64):
        return str(t)
    if t == types.boolean:
        return "bool"
    if isinstance(t, types.UniTuple) and t.dtype == types.int64 and t.count <= 4:
        return f"int64s:{t.count}"
    raise TypeError(f"return type {t}")


def _entry_ir(symbol: str, native: str, params: list) -> str:
    """``i32 symbol(slots*, ret*, exc*)``: numba's function called with the slots' values."""
    lines = [f"define i32 @{symbol}(ptr %slots, ptr %ret, ptr %exc) {{", "entry:"]
    args = []
    for i, ty in enumerate(params):
        lines.append(f"  %p{i} = getelementptr i64, ptr %slots, i64 {i}")
        lines.append(f"  %v{i} = load i64, ptr %p{i}")
        if ty == "i64":
            args.append(f"i64 %v{i}")
            continue
        if ty == "float":
            lines.append(f"  %t{i} = trunc i64 %v{i} to i32")
            lines.append(f"  %a{i} = bitcast i32 %t{i} to float")
        else:
            conv = {"ptr": "inttoptr i64 %v{} to ptr", "double": "bitcast i64 %v{} to double",
                    "i32": "trunc i64 %v{} to i32", "i16": "trunc i64 %v{} to i16",
                    "i8": "trunc i64 %v{} to i8", "i1": "trunc i64 %v{} to i1"}[ty]
            lines.append(f"  %a{i} = " + conv.format(i))
        args.append(f"{ty} %a{i}")
    lines.append(f'  %r = call i32 @"{native}"(ptr %ret, ptr %exc' +
                 "".join(", " + a for a in args) + ")")
    lines += ["  ret i32 %r", "}"]
    return "\n".join(lines)


_DECLARE = re.compile(r'^declare (?P<head>.*?)@"?(?P<name>[^"(]+)"?\((?P<params>.*?)\)(?P<tail>.*)$',
                      re.M)


def _thunks(ir: str, externals: set) -> tuple:
    """``ir`` with each declared function of ``externals`` defined as a call through a
    pointer the loader sets (``stretch_addr_<name>``); and the names so defined."""
    used = []

    def repl(m):
        name = m.group("name")
        if name not in externals:
            return m.group(0)
        used.append(name)
        ret = m.group("head").split()[-1]
        ptys = [p.split()[0] for p in m.group("params").split(",") if p.strip()]
        if any(t == "..." for t in ptys):
            raise TypeError(f"varargs external {name}")
        names = [f"%x{i}" for i in range(len(ptys))]
        call_args = ", ".join(f"{t} {n}" for t, n in zip(ptys, names))
        body = [f"@stretch_addr_{name} = weak global ptr null",
                f'define internal {ret} @"{name}"(' +
                ", ".join(f"{t} {n}" for t, n in zip(ptys, names)) + ") {",
                f"  %f = load ptr, ptr @stretch_addr_{name}"]
        if ret == "void":
            body += [f"  call void %f({call_args})", "  ret void", "}"]
        else:
            body += [f"  %r = call {ret} %f({call_args})", f"  ret {ret} %r", "}"]
        return "\n".join(body)

    return _DECLARE.sub(repl, ir), used


def _object(ir: str, entry: str, tm, externals: set):
    """Object code of one kernel's module: only ``entry`` visible, dead code dropped."""
    import llvmlite.binding as llvm

    mod = llvm.parse_assembly(ir)
    for f in mod.functions:
        if f.name != entry and not f.is_declaration:
            f.linkage = "internal"
    for g in mod.global_variables:
        if not g.is_declaration:
            g.linkage = "internal"
    pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options())
    mpm = llvm.create_new_module_pass_manager()
    mpm.add_global_dead_code_eliminate_pass()
    mpm.add_strip_dead_prototype_pass()
    mpm.run(mod, pb)
    text, used = _thunks(str(mod), externals)
    mod = llvm.parse_assembly(text)
    mod.verify()
    return tm.emit_object(mod), used


def _dispatcher(name: str):
    import importlib

    from numba.core.registry import CPUDispatcher

    modname, _, qual = name.rpartition(".")
    mod = importlib.import_module(modname)
    for v in vars(mod).values():
        if isinstance(v, CPUDispatcher) and v.py_func.__qualname__ == qual \
                and v.py_func.__module__ == modname:
            return v
    return None


def _signature(text: str):
    from numba.core import types

    ns = dict(vars(types))
    ns["bool"] = types.boolean
    return eval(text, {"__builtins__": {}}, ns)  # (a file numba's own types wrote)


def _main(pkg: Path) -> int:
    import llvmlite.binding as llvm

    import spark_stretch.engine  # noqa: F401 (every kernel module, in numba mode)
    from .jit import _SEEN, numba_loaded
    from .native import _externals, cache_dir, library_key, library_path

    assert numba_loaded(), "SPARK_STRETCH_AOT=0 must be set for a build (build() sets it)"
    seen = json.loads((cache_dir(pkg) / _SEEN).read_text())
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        print("no C compiler (cc) to link the kernels' library", file=sys.stderr)
        return 2
    key = library_key(pkg)  # (before compiling: the sources it was built from)
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_default_triple()
    tm = target.create_target_machine(cpu=llvm.get_host_cpu_name(),
                                      features=llvm.get_host_cpu_features().flatten(),
                                      opt=3, reloc="pic", codemodel="default")
    externals = set(_externals())
    entries, used, skipped = [], set(), []
    with tempfile.TemporaryDirectory(prefix="stretch-aot-obj-") as tmp:
        objs = []
        for name, sigs in sorted(seen.items()):
            disp = _dispatcher(name)
            if disp is None:
                skipped.append(f"{name}: no such kernel")
                continue
            for text in sigs:
                try:
                    argtys = _signature(text)
                    disp.compile(argtys)
                    ol = disp.overloads[argtys]
                    args = [_arg_spec(t) for t in argtys]
                    ret = _ret_spec(ol.signature.return_type)
                    ir = ol.library.get_llvm_str()
                    native = ol.fndesc.mangled_name
                    mod = llvm.parse_assembly(ir)
                    params = [str(a.type) for a in mod.get_function(native).arguments][2:]
                    symbol = f"stretch_k{len(entries)}"
                    obj, ext = _object(ir + "\n" + _entry_ir(symbol, native, params), symbol, tm,
                                       externals)
                except Exception as e:  # (a type the loader does not pack: numba's way there)
                    skipped.append(f"{name} {text[:80]}: {type(e).__name__}: {e}")
                    continue
                path = Path(tmp) / f"{symbol}.o"
                path.write_bytes(obj)
                objs.append(str(path))
                used.update(ext)
                entries.append({"kernel": name, "symbol": symbol, "args": args, "ret": ret,
                                "signature": text})
        if not entries:
            print("no kernel signature could be built:\n" + "\n".join(skipped), file=sys.stderr)
            return 3
        out = library_path(pkg, key)
        tmp_so = Path(tmp) / out.name
        r = subprocess.run([cc, "-shared", "-o", str(tmp_so), *objs, "-lm"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(f"linking the kernels' library failed: {r.stderr}", file=sys.stderr)
            return 4
        manifest = {"key": key, "entries": entries, "externals": sorted(used),
                    "skipped": skipped}
        out.parent.mkdir(parents=True, exist_ok=True)
        for old in out.parent.glob("stretch-kernels-*.so"):  # (other keys: stale sources)
            old.unlink(missing_ok=True)
            old.with_suffix(".json").unlink(missing_ok=True)
        pid = os.getpid()
        out.with_suffix(f".json.{pid}").write_text(json.dumps(manifest, indent=1))
        shutil.copyfile(tmp_so, out.with_suffix(f".so.{pid}"))
        os.replace(out.with_suffix(f".json.{pid}"), out.with_suffix(".json"))
        os.replace(out.with_suffix(f".so.{pid}"), out)  # (the .so last: the loader's sign)
    print(json.dumps({"library": str(out), "entries": len(entries), "skipped": skipped}))
    return 0


if __name__ == "__main__":
    pkg = Path(sys.argv[1]) if len(sys.argv) > 1 else _PKG
    if os.environ.get("SPARK_STRETCH_AOT") == "0" and os.environ.get("NUMBA_CACHE_DIR"):
        sys.exit(_main(pkg))  # (build's own process)
    print(build(pkg))  # (a user's command: the build in a process of its own)
