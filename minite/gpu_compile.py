"""Compile minite's Triton kernels for a GPU on a machine without one: the sm_90 / sm_80 gate.

The CPU interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python semantics; it never runs the GPU compiler, so
it accepts what an H100 refuses. Triton's compiler itself needs no GPU: ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))`` goes TTIR -> TTGIR -> LLVM -> PTX -> cubin here.

1. **Record** (``record_launches``): while the tests run under the interpreter, every ``kernel[grid](...)`` launch
   of a minite kernel is written down (a JSON line per distinct launch): the kernel, its constexprs,
   ``num_warps``/``num_stages``, and each argument as the JIT specialises it (Triton's own binder computes it:
   a pointer with ``data_ptr() % 16 == 0`` and an integer ``% 16 == 0`` get ``tt.divisibility = 16``, an integer
   equal to 1 becomes a constexpr). Compiled without that, a kernel has other vector widths, no cp.async
   pipelining and other registers: the old gate's phantom spills.
2. **Capture a GPU's launches** (``capture_gpu_launches``, ``--examples``): the interpreter tests pick small
   tiles. minite/gpu_examples.py calls every family's launchers at the benchmarks' shapes with the launchers
   choosing a GPU's tiles (``_common.gpu_tiles``), recording each launch without running it.
3. **Compile** (``python -m minite.gpu_compile RECORDS... [--examples]``): each distinct launch for sm_90 and
   sm_80, with its float scalars typed twice: ``fp32``, as an eager launch passes a Python float, and ``fp64``,
   as Inductor types it when ``torch.compile`` traces a ``triton_op`` (the H100 crash of 2026-11-25: an fp64
   ``qk_scale`` turned the loop-carried ``m_i`` into fp64). Every launch fails on a compile error, on an ``f64``
   value past the kernel's entry when no input is fp64, and on shared memory over the architecture's per-block
   limit. A GPU tile also fails, on sm_90, on what makes Hopper slow: register spills (``ptxas -v``; the
   budget in gpu_examples.SPILL_BUDGET, 0 by default), a ``tl.dot`` that misses wgmma (any with M >= 64; one with
   fewer rows only where the kernel's module says why, ``MMA_SYNC_OK = {"_kernel": "why"}``), a wgmma layout
   that replicates work across warpgroups (``warpsPerCTA[0] * 16`` above the dot's M), and an FP8 dot that
   accumulates past its promotion interval. It is compiled for sm_80 when it may not fit an A100 (SM80_SHARE).

**FP8 promotion interval (the convention a kernel follows).** A kernel with an FP8 ``tl.dot`` states, in its own
module, how many products one output element may sum in the tensor core's reduced-precision FP8 accumulator
before that partial sum is added into an fp32 register (DeepSeek-V3 and chapter 02: 128)::

    PROMOTION_INTERVAL = {"_fp8_gemm_kernel": "BLOCK_K",       # the value of that constexpr
                          "_block_scaled_kernel": 128,          # a number
                          "_other_kernel": lambda c: c["BLOCK_K"] if c["SPLIT_ACC"] else None}  # per launch

A value is an int, the name of a constexpr, or a function of the launch's constexprs (a dict); ``None`` states
"no promotion, on purpose" (a fast-accumulation mode, as ``torch._scaled_mm(use_fast_accum=True)``). The gate
reads each FP8 dot's interval from its sm_90 TTGIR: ``maxNumImpreciseAcc`` when it is at most the dot's K (Triton
then promotes every ``maxNumImpreciseAcc`` products); else the dot's K when the dot starts from zero (no ``acc``
argument: the kernel adds the result in fp32 itself, as a block-scaled GEMM does); else unbounded (the
accumulator is carried through the K loop in reduced precision: Triton's default, 2**30). It fails when that
exceeds the stated interval, and when a kernel with an FP8 dot states none: unstated is a failure, never a default.

What it cannot show: speed, numerics (TF32 in ``tl.dot``), launch-time limits (grid size). Those need a GPU.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import functools
import inspect
import json
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path

__all__ = ["record_launches", "launch_record", "capture_gpu_launches", "compile_record", "kernel_names", "main",
           "SHARED_LIMIT"]

# Shared memory one block may use (bytes): H100 227 KiB, A100 163 KiB (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SHARED_LIMIT = {90: 232448, 80: 166912}
# Kernels on fp8 operands: Ampere (sm_80) has no fp8 tensor cores; minite refuses fp8 there (formats/fp8.py).
_FP8_TYPES = ("fp8e4nv", "fp8e5")

_TORCH_TO_TL = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
                "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
                "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


# ------------------------------------------------------------------------------------------------ recording
def _is_constexpr(param: inspect.Parameter) -> bool:
    a = param.annotation
    return (a is not inspect.Parameter.empty and
            (getattr(a, "__name__", "") == "constexpr" or (isinstance(a, str) and a.endswith("constexpr"))))


def _const(v):
    """A constexpr value as JSON: numbers, strings, None, or a Triton dtype ({"dtype": "fp32"})."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    name = getattr(v, "name", None)  # tl.dtype
    if name is not None:
        return {"dtype": str(name)}
    value = getattr(v, "value", v)  # tl.constexpr(...)
    if value is not v:
        return _const(value)
    raise TypeError(f"cannot record constexpr {v!r}")


def _type(v) -> str:
    """Triton's type for a runtime argument; "float" stands for a Python float (fp32 eager, fp64 Inductor)."""
    if hasattr(v, "dtype") and hasattr(v, "data_ptr"):
        return "*" + _TORCH_TO_TL[str(v.dtype).replace("torch.", "")]
    if isinstance(v, bool):
        return "u1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "float"
    raise TypeError(f"cannot type kernel argument {v!r}")


_DIV16 = [["tt.divisibility", 16]]


@functools.lru_cache(maxsize=None)
def _jit_binder(fn, dns: tuple, dnsa: tuple):
    """Triton's own binder for `fn` (what ``JITFunction.run`` calls on every launch), bound to an sm_90 backend:
    (JITFunction, backend, binder). Needs no GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jf = JITFunction(fn, do_not_specialize=list(dns), do_not_specialize_on_alignment=list(dnsa))
    backend = make_backend(GPUTarget("cuda", 90, 32))
    return jf, backend, create_function_from_signature(jf.signature, jf.params, backend)


def _jit_specialise(fn, args, kwargs, jit_kwargs) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) by name, as the JIT computes them: its binder types each argument and
    specialises it (``specialize_impl``: a pointer whose data_ptr % 16 == 0 and an integer % 16 == 0 get "D", an
    integer equal to 1 becomes a constexpr), and the backend turns "D" into ``tt.divisibility = 16``."""
    jf, backend, binder = _jit_binder(fn, tuple(jit_kwargs.get("do_not_specialize") or ()),
                                      tuple(jit_kwargs.get("do_not_specialize_on_alignment") or ()))
    bound, spec, _ = binder(*args, **kwargs)
    sig, consts, attrs = {}, {}, {}
    for p, (ty, val) in zip(jf.params, spec):
        v = bound[p.name]
        if ty == "constexpr":
            consts[p.name] = _const(v)
            continue
        sig[p.name] = "float" if isinstance(v, float) and not p.annotation_type else ty
        a = backend.parse_attr(val) if isinstance(val, str) else []
        if a:
            attrs[p.name] = a
    return sig, consts, attrs


def _rule_specialise(fn, args, kwargs) -> tuple[dict, dict, dict]:
    """The same by the rule the JIT follows (triton 3.x), for a Triton whose binder this module cannot call."""
    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip([p.name for p in params], args))
    bound.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
    sig, consts, attrs = {}, {}, {}
    for p in params:
        v = bound.get(p.name, p.default)
        if _is_constexpr(p) or v is None or (type(v) is int and v == 1):
            consts[p.name] = _const(v)
            continue
        sig[p.name] = _type(v)
        if (sig[p.name].startswith("*") and v.data_ptr() % 16 == 0) or (type(v) is int and v % 16 == 0):
            attrs[p.name] = _DIV16
    return sig, consts, attrs


def launch_record(fn, args: tuple, kwargs: dict, jit_kwargs: dict | None = None) -> dict:
    """The record of one launch of the plain Python kernel function `fn` with `args`/`kwargs` (`jit_kwargs`: the
    ``@triton.jit(...)`` options, e.g. do_not_specialize): types, constexprs, and the JIT's specialisation."""
    try:
        sig, consts, attrs = _jit_specialise(fn, args, kwargs, jit_kwargs or {})
        how = "jit"
    except (ImportError, AttributeError, TypeError, ValueError):  # a Triton whose internals differ
        sig, consts, attrs = _rule_specialise(fn, args, kwargs)
        how = "rule"
    return {"module": fn.__module__, "kernel": fn.__name__, "signature": sig, "constexprs": consts,
            "attrs": attrs, "spec": how,
            "num_warps": int(kwargs.get("num_warps", 4)), "num_stages": int(kwargs.get("num_stages", 3))}


def record_launches(path: str | os.PathLike) -> None:
    """From now on, append each distinct launch of a ``minite.*`` kernel under the interpreter to `path`
    (JSON lines). Patches the interpreter's ``InterpretedFunction.run``; call before kernels launch."""
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(InterpretedFunction.run, "_minite_recorder", None) == str(path):
        return
    orig = getattr(InterpretedFunction.run, "_minite_orig", InterpretedFunction.run)
    seen: set[str] = set()

    @functools.wraps(orig)
    def run(self, *args, grid, warmup, **kwargs):
        if getattr(self.fn, "__module__", "").startswith("minite."):
            try:
                line = json.dumps(launch_record(self.fn, args, kwargs, getattr(self, "kwargs", None)),
                                  sort_keys=True)
            except TypeError as e:  # an argument the gate cannot type: record it as a failure to see
                line = json.dumps({"module": self.fn.__module__, "kernel": self.fn.__name__, "error": str(e)})
            if line not in seen:
                seen.add(line)
                with open(path, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    run._minite_recorder, run._minite_orig = str(path), orig
    InterpretedFunction.run = run


@contextlib.contextmanager
def capture_gpu_launches():
    """Inside: the launchers pick a GPU's tiles (``_common.CAPTURE_GPU.on``: ``gpu_tiles`` true, ``sm_count`` an
    H100's 132) and the flags a GPU sets (``interpreting()`` false: no UPCAST), and every kernel launch is written
    down, with the JIT's specialisation, and NOT run: CPU tensors from ``torch.empty`` at the benchmarks' shapes
    cost nothing. Yields the list of records (``"tiles": "gpu"``). Needs ``TRITON_INTERPRET=1`` (the kernels must
    be interpreted functions, whose launch is patched here); one thread at a time."""
    from triton.runtime.interpreter import InterpretedFunction

    import minite._triton as mt
    from minite.kernels._common import CAPTURE_GPU

    if not mt._INTERPRET_AT_IMPORT:
        raise RuntimeError("capture_gpu_launches needs TRITON_INTERPRET=1 when minite is imported")
    records: list[dict] = []
    saved = InterpretedFunction.run, getattr(CAPTURE_GPU, "on", False)

    def run(self, *args, grid, warmup, **kwargs):
        try:
            rec = launch_record(self.fn, args, kwargs, getattr(self, "kwargs", None))
        except TypeError as e:
            rec = {"module": self.fn.__module__, "kernel": self.fn.__name__, "error": str(e)}
        records.append(dict(rec, tiles="gpu"))

    InterpretedFunction.run, CAPTURE_GPU.on, mt._INTERPRET_AT_IMPORT = run, True, False
    try:
        yield records
    finally:
        InterpretedFunction.run, CAPTURE_GPU.on, mt._INTERPRET_AT_IMPORT = saved[0], saved[1], True


# ------------------------------------------------------------------------------------------------ compiling
def kernel_names() -> set[str]:
    """"module:name" of every launchable ``@triton.jit`` kernel in minite (those named ``_*_kernel``)."""
    import importlib
    import pkgutil

    import minite
    out = set()
    for m in pkgutil.walk_packages(minite.__path__, "minite."):
        if m.name.startswith(("minite.gpu_compile", "minite.train")) or m.name.endswith(".__main__"):
            continue  # entry points: importing one runs it
        try:
            mod = importlib.import_module(m.name)
        except ImportError:  # an optional extra that is not installed (minite.hf: transformers) holds no kernel
            continue
        for name, obj in vars(mod).items():
            if name.endswith("_kernel") and hasattr(obj, "arg_names") and getattr(obj, "fn", None) is not None \
                    and obj.fn.__module__ == m.name:
                out.add(f"{m.name}:{name}")
    return out


def _f64_leaks(ttir: str, floats: set[str]) -> list[str]:
    """TTIR lines that compute in f64, other than truncating an f64 argument (a float scalar, or the parameter of
    a helper such as ``_acc`` that receives one) to f32, and calls that hand it to such a helper."""
    args = set(floats) | set(re.findall(r"%(\w+): f64", " ".join(
        ln for ln in ttir.splitlines() if ln.lstrip().startswith("tt.func"))))
    out = []
    for ln in ttir.splitlines():
        ln = ln.strip()
        if "f64" not in ln or ln.startswith(("tt.func", "#", "loc")):
            continue
        m = re.search(r"arith\.truncf %(\w+) : f64 to f32", ln) or \
            re.search(r"tt\.call @\S+\(%(\w+)\) : \(f64\) -> f32", ln)
        if m and (m.group(1) in args or m.group(1).startswith("arg")):
            continue
        out.append(ln)
    return out


def _ttir(src, target, options: dict) -> str:
    """The kernel's TTIR as code generation writes it (the step that raised the H100's loop-carried fp64 error),
    without the optimisation passes, PTX and cubin: a tenth of a full compile. Falls back to a full compile on
    a Triton whose internals differ."""
    import triton
    try:
        from triton._C.libtriton import ir
        from triton.compiler.compiler import make_backend
        backend = make_backend(target)
        opts = backend.parse_options(options)
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        return str(src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(),
                               context))
    except (ImportError, AttributeError, TypeError):
        return triton.compile(src, target=target, options=options).asm["ttir"]


def _ptxas_usage(ptx: str, arch: int) -> dict:
    """{"n_regs", "n_spills"} from ``ptxas -v`` on the kernel's PTX (the driver reports them only on a GPU). Kept
    beside Triton's cache, by the PTX's hash: a warm gate runs no ptxas."""
    import hashlib
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(arch).path
    key = hashlib.sha256(f"{ptxas}\n{arch}\n{ptx}".encode()).hexdigest()
    cache = _cache_dir() / "minite-ptxas" / f"{key}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{'a' if arch == 90 else ''}",
                            str(src), "-o", str(Path(d) / "k.o")], capture_output=True, text=True)
    log = r.stdout + r.stderr
    if r.returncode:  # no register report is no pass
        raise RuntimeError(f"ptxas -v failed: {log.strip()[-400:]}")
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    out = {"n_regs": int(regs.group(1)) if regs else None, "n_spills": max(spills, default=0)}
    if regs:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(out))
        tmp.replace(cache)
    return out


def _cache_dir() -> Path:
    try:
        from triton import knobs
        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        return Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))


# ------------------------------------------------------------------------------------- reading the sm_90 build
_MMA = re.compile(r"^#(\w+) = #ttg\.nvidia_mma<\{versionMajor = (\d+), versionMinor = \d+, warpsPerCTA = \[([\d, ]+)\]")
_DOT = re.compile(r"= (tt\.dot|ttng\.warp_group_dot) ([^:]*?) : (?:tensor|!ttg\.memdesc)<(\d+)x(\d+)x(\w+)"
                  r".*-> tensor<(\d+)x(\d+)x\w+, #(\w+)>")


def read_dots(ttgir: str) -> list[dict]:
    """Every distinct ``tl.dot`` of a TTGIR: {"M", "N", "K", "a" (operand type), "mma" (3 = wgmma, 2 = mma.sync,
    0 = FMA), "warps" (warpsPerCTA), "imprecise" (maxNumImpreciseAcc or None), "fresh" (starts from zero)}."""
    layouts = {m.group(1): (int(m.group(2)), [int(w) for w in m.group(3).split(",")])
               for m in map(_MMA.match, ttgir.splitlines()) if m}
    zeros = set(re.findall(r"(%[\w.#]+) = arith\.constant (?:dense<0\.0+e\+00>|false) ", ttgir))
    out, seen = [], set()
    for ln in ttgir.splitlines():
        if " tt.dot " not in ln and " ttng.warp_group_dot " not in ln:
            continue
        imprecise = re.search(r"maxNumImpreciseAcc = (\d+)", ln)
        m = _DOT.search(re.sub(r"\{[^{}]*\}", "", ln.split(" loc(")[0]))
        if not m:
            continue
        operands = [o.strip() for o in m.group(2).split(",") if o.strip().startswith("%")]
        mma, warps = layouts.get(m.group(8), (0, []))
        d = {"M": int(m.group(6)), "N": int(m.group(7)), "K": int(m.group(4)), "a": m.group(5), "mma": mma,
             "warps": warps, "imprecise": int(imprecise.group(1)) if imprecise else None,
             "fresh": len(operands) > 2 and (operands[2] in zeros or operands[3:] == ["%false"])}
        key = json.dumps(d, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def promotion_interval(d: dict) -> int | None:
    """Products an fp8 dot sums in the tensor core's reduced-precision accumulator before an fp32 add (see the
    module's docstring); None for a dot that is not fp8."""
    if not d["a"].startswith("f8"):
        return None
    acc = d["imprecise"] if d["imprecise"] is not None else 2**30
    if acc <= d["K"]:
        return acc
    return d["K"] if d["fresh"] else acc


def _statement(module, name: str, kernel: str, consts: dict):
    """The kernel's entry in its module's dict `name` (PROMOTION_INTERVAL, MMA_SYNC_OK): (stated?, value)."""
    table = getattr(module, name, None) or {}
    if kernel not in table:
        return False, None
    v = table[kernel]
    if isinstance(v, str) and name == "PROMOTION_INTERVAL":
        v = consts[v]
    elif callable(v):
        v = v(consts)
    return True, v


def sm90_findings(ttgir: str, ptx: str, module, kernel: str, consts: dict) -> tuple[dict, list[str]]:
    """What makes Hopper fast, read off one sm_90 build: (facts, failures). Fails on a dot with M >= 64 not on
    wgmma, on any other dot off wgmma unless the module's ``MMA_SYNC_OK[kernel]`` says why, on a wgmma layout that
    replicates work across warpgroups, and on an fp8 dot whose promotion interval exceeds the stated one."""
    dots = read_dots(ttgir)
    facts = {"wgmma": ptx.count("wgmma.mma_async"), "mma_sync": len(re.findall(r"\bmma\.sync\b", ptx)),
             "dots": dots, "replicated": False, "interval": None}
    bad = []
    small_ok, why_small = _statement(module, "MMA_SYNC_OK", kernel, consts)
    stated, limit = _statement(module, "PROMOTION_INTERVAL", kernel, consts)
    for d in dots:
        shape = f"{d['M']}x{d['N']}x{d['K']} {d['a']}"
        if d["mma"] != 3 and not (d["mma"] == 0 and d["a"] == "f32"):  # fp32 FMA: exact fp32 asked for
            kind = "mma.sync (MMAv2)" if d["mma"] == 2 else "FMA"
            if d["M"] >= 64:
                bad.append(f"dot {shape} lowers to {kind}, not wgmma")
            elif not small_ok:
                bad.append(f"dot {shape} lowers to {kind}, not wgmma: its M-tile {d['M']} < 64 rows (a warpgroup); "
                           "take BLOCK_M >= 64, or state why in the module's MMA_SYNC_OK")
        if d["mma"] == 3 and d["warps"] and d["warps"][0] * 16 > d["M"]:
            facts["replicated"] = True
            bad.append(f"dot {shape}: warpsPerCTA {d['warps']} puts {d['warps'][0] * 16} rows of warps on M = "
                       f"{d['M']}: the warpgroups compute the same rows")
        iv = promotion_interval(d)
        if iv is None:
            continue
        facts["interval"] = max(facts["interval"] or 0, iv)
        if not stated:
            bad.append(f"fp8 dot {shape} (promotion every {iv} products) in a kernel with no PROMOTION_INTERVAL")
        elif limit is not None and iv > limit:
            bad.append(f"fp8 dot {shape} promotes every {iv} products, more than the stated {limit}")
    return facts, bad


def build(rec: dict, arch: int = 90, float_type: str = "fp32"):
    """The CompiledKernel of a record, compiled as the JIT compiles it (its specialisation, options)."""
    import triton
    src, target, options, _ = _source(rec, arch, float_type)
    return triton.compile(src, target=target, options=options)


def _source(rec: dict, arch: int, float_type: str):
    import importlib

    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(rec["module"]), rec["kernel"])
    types = {n: rec["signature"].get(n, "i32") for n in fn.arg_names}  # a hand-written record may leave ints out
    sig = {n: ("constexpr" if n in rec["constexprs"] else float_type if types[n] == "float" else types[n])
           for n in fn.arg_names}
    dtypes = {d.name: d for d in vars(tl).values() if isinstance(d, tl.dtype)}  # "fp32" -> tl.float32
    consts = {k: dtypes[v["dtype"]] if isinstance(v, dict) else v for k, v in rec["constexprs"].items()}
    attrs = {(fn.arg_names.index(n),): [list(a) for a in v] for n, v in rec.get("attrs", {}).items()}
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return src, GPUTarget("cuda", arch, 32), {"num_warps": rec["num_warps"], "num_stages": rec["num_stages"]}, sig


def compile_record(rec: dict, arch: int, float_type: str, check_spills: bool | int = False) -> dict:
    """Compile one recorded launch for sm_`arch` with its floats typed `float_type`. Returns a result dict:
    {"ok": bool, "why": str, "shared": int, "n_regs": int, "n_spills": int, and for a GPU tile on sm_90 the
    facts of sm90_findings}. ``check_spills``: True (none allowed) or 1 + the bytes allowed."""
    import importlib
    import sys as _sys

    import triton

    src, target, options, sig = _source(rec, arch, float_type)
    uses_fp8 = any(t.lstrip("*") in _FP8_TYPES for t in sig.values()) or any(
        isinstance(v, dict) and v["dtype"] in _FP8_TYPES for v in rec["constexprs"].values())
    if arch < 89 and uses_fp8:
        return {"ok": True, "why": "skipped: fp8 needs sm_89+ (minite refuses fp8 below)", "skipped": True}
    floats = {n for n, t in rec["signature"].items() if t == "float"}
    any_fp64_input = any(t.lstrip("*") == "fp64" for n, t in sig.items() if n not in floats)
    try:
        if float_type == "fp64":  # after the entry's cast the rest is the fp32 compile: the TTIR is the question
            leaks = _f64_leaks(_ttir(src, target, options), floats)
            if leaks and not any_fp64_input:
                return {"ok": False, "why": f"an fp64 float scalar leaks into the kernel's math: {leaks[0][:200]}"}
            return {"ok": True, "why": ""}
        k = triton.compile(src, target=target, options=options)
    except Exception as e:  # noqa: BLE001 - any compiler error is the finding
        msg = str(e).strip().splitlines()
        return {"ok": False, "why": f"compile error: {' | '.join(msg[-4:])[:600]}"}
    md = k.metadata
    res, bad = {"ok": True, "why": "", "shared": md.shared}, []
    gpu = rec.get("tiles") == "gpu" and arch == 90
    if check_spills or gpu:
        res.update(_ptxas_usage(k.asm["ptx"], arch))
    if md.shared > SHARED_LIMIT[arch]:
        bad.append(f"shared memory {md.shared} B > sm_{arch}'s {SHARED_LIMIT[arch]} B per block")
    allowed = int(check_spills) - 1 if check_spills not in (False, True) else 0  # an int: 1 + the bytes allowed
    if (check_spills or gpu) and res["n_spills"] > allowed:
        bad.append(f"{res['n_spills']} bytes of register spills (allowed {allowed}), {res['n_regs']} registers")
    if gpu:
        importlib.import_module(rec["module"])
        facts, why = sm90_findings(k.asm["ttgir"], k.asm["ptx"], _sys.modules[rec["module"]], rec["kernel"],
                                   rec["constexprs"])
        res.update(facts)
        bad += why
    return dict(res, ok=not bad, why="; ".join(bad))


def _job(rec, arch, float_type, check_spills):
    t0 = time.perf_counter()
    try:
        res = compile_record(rec, arch, float_type, check_spills)
    except Exception as e:  # noqa: BLE001 - e.g. the kernel cannot be imported
        res = {"ok": False, "why": f"{type(e).__name__}: {e}"}
    return dict(res, seconds=round(time.perf_counter() - t0, 2))


def load_records(paths) -> list[dict]:
    """Distinct records from JSON-lines files (order kept)."""
    seen, out = set(), []
    for p in paths:
        for line in Path(p).read_text(encoding="utf-8").splitlines():
            if line.strip() and line not in seen:
                seen.add(line)
                out.append(json.loads(line))
    return out


def describe(rec: dict) -> str:
    c = rec.get("constexprs", {})
    blocks = ",".join(f"{k}={v}" for k, v in sorted(c.items()) if not isinstance(v, dict) and k != "HEAD_DIM")
    ptrs = sorted({t for t in rec.get("signature", {}).values() if t.startswith("*")})
    return (f"{rec['kernel']}[{blocks}; {'/'.join(ptrs)}; warps={rec.get('num_warps')}"
            f"{'' if rec.get('num_stages', 3) == 3 else ', stages=%d' % rec['num_stages']}]")


def _facts(res: dict) -> str:
    """One GPU tile's sm_90 build in a line: registers, spills, wgmma / mma.sync, replication, fp8 interval."""
    dots = res.get("dots", [])
    shapes = sorted({f"{d['M']}x{d['N']}x{d['K']}" for d in dots})
    acc = sorted({d["imprecise"] for d in dots if d["a"].startswith("f8") and d["imprecise"] is not None})
    iv = res.get("interval")
    fp8 = "" if iv is None else (f" maxNumImpreciseAcc {'/'.join(map(str, acc))}: " +
                                 ("never promoted" if iv >= 2**30 else f"promoted every {iv} products"))
    return (f"regs {res.get('n_regs')} spills {res.get('n_spills')} smem {res.get('shared', 0) // 1024}K "
            f"wgmma {res.get('wgmma')} mma.sync {res.get('mma_sync')} dots {' '.join(shapes) or '-'} "
            f"replicated {'YES' if res.get('replicated') else 'no'}{fp8}")


# A GPU tile is compiled for sm_80 too when its sm_90 build takes more than this share of an A100's shared memory
# per block. Measured (triton 3.7.1, 2026-11-28, attention and LoRA GPU tiles): sm_80 takes 1.17-1.5x LESS than
# sm_90 (mma.sync keeps operand A in registers, wgmma reads both from shared memory), so a tile under half the
# A100's limit on sm_90 cannot exceed it there. The suite's own launches are compiled for sm_80 always.
SM80_SHARE = 0.5


def gate(records: list[dict], archs=(90, 80), jobs: int | None = None, require: set[str] | None = None,
         check_spills: bool = False, spill_budget: dict | None = None, log=print) -> int:
    """Compile every record for each arch with float scalars typed fp32 (an eager launch), and generate the TTIR
    of those with float scalars typed fp64 (Inductor). A GPU tile (``"tiles": "gpu"``, from
    capture_gpu_launches) also gets sm90_findings and ptxas on sm_90 with no spill beyond
    ``spill_budget[describe(record)]`` bytes (0 when absent), and sm_80 only past SM80_SHARE. ``check_spills``:
    the same spill check for every record. Returns the failure count."""
    bad = [r for r in records if "error" in r]
    for r in bad:
        log(f"FAIL {r['kernel']}: could not record its launch ({r['error']})")
    records = [r for r in records if "error" not in r]
    budget = spill_budget or {}
    jobs_list, later = [], []
    for r in records:
        gpu = r.get("tiles") == "gpu"
        for arch in archs:
            spill = (1 + budget.get(describe(r), 0)) if (check_spills or gpu) and arch == 90 else False
            (later if gpu and arch != 90 and 90 in archs else jobs_list).append((r, arch, "fp32", spill))
        if "float" in r["signature"].values():  # Inductor's typing: a TTIR question, the same on every arch
            jobs_list.append((r, archs[0], "fp64", False))
    t0, fails, skipped, n_jobs = time.perf_counter(), len(bad), 0, 0
    shared90 = {}
    n = jobs or max(1, min(len(jobs_list), os.cpu_count() or 1))
    # spawn, not fork: forking a process that has imported torch/triton (threads) can deadlock its children
    with cf.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as ex:
        for batch in (jobs_list, later):
            if batch is later:  # sm_80 for the GPU tiles that may not fit an A100
                batch = [j for j in later if shared90.get(id(j[0]), 1 << 30) > SM80_SHARE * SHARED_LIMIT[80]]
            n_jobs += len(batch)
            futs = {ex.submit(_job, *j): j for j in batch}
            for f in cf.as_completed(futs):
                r, arch, ft, _ = futs[f]
                res = f.result()
                skipped += bool(res.get("skipped"))
                if arch == 90 and ft == "fp32":
                    shared90[id(r)] = res.get("shared", 1 << 30)
                if r.get("tiles") == "gpu" and arch == 90 and ft == "fp32" and "wgmma" in res:
                    log(f"  GPU tile {describe(r)}: {_facts(res)}")
                elif res.get("n_spills"):
                    log(f"spills sm_{arch} {describe(r)}: {res['n_spills']} bytes, {res['n_regs']} registers")
                if not res["ok"]:
                    fails += 1
                    log(f"FAIL sm_{arch} floats={ft} {describe(r)} ({r['module']}): {res['why']}")
    kernels = {f"{r['module']}:{r['kernel']}" for r in records}
    missing = sorted((require or set()) - kernels)
    for m in missing:
        fails += 1
        log(f"FAIL {m}: no test launched this kernel, so the gate could not compile it")
    n_gpu = sum(r.get("tiles") == "gpu" for r in records)
    log(f"sm_{'/sm_'.join(map(str, archs))} compile gate: {len(kernels)} kernels, {len(records)} launch "
        f"configurations ({n_gpu} GPU tiles), {n_jobs} compiles ({skipped} fp8-on-sm_80 skipped) in "
        f"{time.perf_counter() - t0:.0f} s: {fails} failed")
    return fails


def capture_examples(families=None) -> list[dict]:
    """The GPU's launches of minite.gpu_examples' `families` (all by default), recorded in THIS process (which
    must interpret: TRITON_INTERPRET=1). A family that raises is one record with its error."""
    import traceback

    from minite import gpu_examples
    out = []
    for name in families or list(gpu_examples.FAMILIES):
        try:
            with capture_gpu_launches() as recs:
                gpu_examples.FAMILIES[name]()
        except Exception as e:  # noqa: BLE001 - a launcher that cannot capture is a gate failure to read
            where = traceback.extract_tb(e.__traceback__)[-1]
            recs = [{"module": "minite.gpu_examples", "kernel": name, "tiles": "gpu",
                     "error": f"{type(e).__name__}: {e} ({Path(where.filename).name}:{where.lineno})"}]
        out += [dict(r, family=name) for r in recs]
    return out


def _examples(families) -> list[dict]:
    """capture_examples in a child process that interprets (this one compiles for the GPU); distinct records."""
    import subprocess
    import tempfile

    from minite import gpu_examples
    unknown = set(families or ()) - set(gpu_examples.FAMILIES)
    if unknown:
        raise SystemExit(f"unknown example families {sorted(unknown)}; there are {sorted(gpu_examples.FAMILIES)}")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "examples.jsonl"
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-m", "minite.gpu_compile", "--capture", str(path), *(families or ())],
                           env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"capturing the GPU examples failed:\n{(r.stdout + r.stderr)[-3000:]}")
        recs = [json.loads(ln) for ln in path.read_text().splitlines()]
    seen, out = set(), []
    for rec in recs:
        key = json.dumps({k: v for k, v in rec.items() if k != "family"}, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(rec)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minite.gpu_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="*", help="JSON-lines files written by record_launches, or folders of them")
    p.add_argument("--examples", nargs="*", metavar="FAMILY", default=None,
                   help="also capture and gate the GPU tiles of minite/gpu_examples.py (all families, or these)")
    p.add_argument("--capture", metavar="FILE", help=argparse.SUPPRESS)  # the child of --examples
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--require-all", action="store_true", help="fail when a minite kernel was never launched")
    a = p.parse_args(argv)
    if a.capture:
        recs = capture_examples(a.records or None)
        Path(a.capture).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in recs))
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("run with TRITON_INTERPRET unset: the kernels must be decorated for the GPU compiler")
    files = [f for r in a.records for f in (sorted(Path(r).glob("*.jsonl")) if Path(r).is_dir() else [Path(r)])
             if f.exists()]  # on CUDA the suite records nothing: no folder
    records = load_records(files)
    if a.records and not records:
        import torch
        if not torch.cuda.is_available():  # on CUDA no interpreter ran: the GPU's own Triton compiled every kernel
            print(f"sm_90/sm_80 compile gate: FAIL, no launch was recorded in {a.records} (was the suite run with "
                  "MINITE_RECORD_LAUNCHES and TRITON_INTERPRET=1?)")
            return 1
        print("sm_90/sm_80 compile gate: no launch recorded (the kernels ran on CUDA and compiled there)")
    if a.examples is not None:
        from minite.gpu_examples import SPILL_BUDGET
        t0 = time.perf_counter()
        examples = _examples(a.examples)
        print(f"GPU examples: {len(examples)} distinct launches of {len({r['family'] for r in examples})} "
              f"families captured in {time.perf_counter() - t0:.1f} s")
        records += examples
    if not records:
        p.error("nothing to compile: give record files or folders, or --examples")
    require = kernel_names() if a.require_all and files else None
    budget = SPILL_BUDGET if a.examples is not None else None
    return 1 if gate(records, a.arch, a.jobs, require, spill_budget=budget) else 0


if __name__ == "__main__":
    sys.exit(main())
