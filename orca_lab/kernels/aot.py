"""Ahead-of-time compilation of every kernel for GPUs this machine need not have.

    TRITON_INTERPRET=0 python -m orca_lab.kernels.aot [--targets 80 90] [--jobs 2] [--modules ...] [--full] [--match RE]

Triton's interpreter runs the kernels on a CPU, but it accepts code the GPU compiler refuses (a
``tl.dot`` with an inner dimension below 16) and says nothing of shared memory. Triton's compiler and
``ptxas`` ship in the wheel, so each kernel can be compiled to a cubin for an A100 (sm_80) or an H100
(sm_90) without either, and its shared memory compared with the device's limit per block.

**How a kernel module declares its launches.** Every module of ``orca_lab.kernels`` that holds a
launched ``@triton.jit`` kernel defines ``aot_launches()``, yielding one ``launches.launch(kernel, what, **args)``
per way its wrapper can launch it on a GPU: the constexprs from the same block-size helpers the
wrapper calls, over every size class it accepts (head sizes 1 to 256, odd ones included, each float
dtype, decode and prefill shapes...), and example arguments: meta tensors (shape, strides and dtype,
no memory) and the ints and floats the wrapper passes. ``launch`` types them as Triton's launcher
does (pointer dtypes, 16-divisibility, an int equal to 1 turned into a constant), so what is compiled
is what a launch would compile; launches that compile the same are kept once. A ``@triton.jit`` that
no other one calls is a launched kernel: ``check_coverage`` refuses one that no ``aot_launches``
declares, so a kernel added later cannot slip past the check.

Run this module in a process with ``TRITON_INTERPRET=0`` (interpreted kernels cannot be compiled).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import sys
import time
from dataclasses import replace

from orca_lab.kernels.launches import Launch


# Shared memory one block may use (the opt-in maximum, cudaDevAttrMaxSharedMemoryPerBlockOptin), from
# the CUDA C++ Programming Guide's table of compute capabilities: A100 (sm_80) 163 KB, H100 (sm_90)
# 227 KB; A10/RTX 30xx (sm_86) and L4/RTX 40xx (sm_89) 99 KB. The check defaults to the paper's
# and today's datacenter GPUs; ``--targets 86 89`` asks about the others.
SHARED_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
DEVICES = {80: "A100 (sm_80)", 86: "A10 / RTX 30xx (sm_86)", 89: "L4 / RTX 40xx (sm_89)", 90: "H100 (sm_90)"}
DEFAULT_TARGETS = (80, 90)


# ------------------------------------------------------------------------------------ discovery
def kernel_modules(names=None) -> list:
    """The modules to check: ``names``, or every module of ``orca_lab.kernels``."""
    if names:
        return [importlib.import_module(n) for n in names]
    import orca_lab.kernels as pkg
    return [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]


def jit_functions(module) -> dict:
    """The ``@triton.jit`` functions defined in ``module`` (not imported into it), by name."""
    from triton.runtime.jit import JITFunction
    return {name: f for name, f in vars(module).items()
            if isinstance(f, JITFunction) and f.fn.__module__ == module.__name__}


def launched_kernels(modules) -> dict:
    """Every ``@triton.jit`` that no other one calls, by qualified name: those a wrapper launches."""
    fns = {f"{m.__name__}.{n}": f for m in modules for n, f in jit_functions(m).items()}
    called = {n for n, f in fns.items() for g in fns.values()
              if g is not f and re.search(rf"\b{re.escape(f.fn.__name__)}\s*\(", g.src)}
    return {n: f for n, f in fns.items() if n not in called}


def declared_launches(modules) -> list[Launch]:
    """Every module's ``aot_launches()``, each distinct compile once (first description kept; quick
    if any of its declarations is)."""
    unique = {}
    for m in modules:
        for lc in getattr(m, "aot_launches", lambda: ())():
            seen = unique.setdefault(lc.key, lc)
            if lc.quick and not seen.quick:
                unique[lc.key] = replace(seen, quick=True)
    return list(unique.values())


def ci_subset(launches) -> list[Launch]:
    """What CI compiles within a minute or two on 2 cores: of the quick launches, for each kernel,
    family (``Launch.family``: grouped-query attention's group sizes) and set of float dtypes it
    takes, the first declared (the wrapper's default) and the one with the
    largest tiles (the product of its ``BLOCK_*`` constexprs and stages: the most shared memory).
    ``--full`` compiles every declared launch (a GPU host's many cores do it in minutes)."""
    groups: dict = {}
    for lc in launches:
        if lc.quick:
            groups.setdefault((lc.name, lc.family, _float_types(lc)), []).append(lc)
    out = []
    for group in groups.values():
        biggest = max(group, key=_tiles)
        out += [group[0]] if biggest is group[0] else [group[0], biggest]
    return out


def _float_types(lc: Launch) -> tuple[str, ...]:
    """The float pointer types a launch takes: a kernel that reads fp32 partials and writes fp16
    (the split-K merge) is its own group, not fp32's."""
    return tuple(sorted({t for t in lc.signature.values() if t in ("*fp32", "*fp16", "*bf16")}))


def _tiles(lc: Launch) -> int:
    size = lc.num_stages
    for name, value in lc.constexprs.items():
        if name.startswith("BLOCK") and isinstance(value, int):
            size *= value
    return size


def check_coverage(modules, launches) -> None:
    """Refuse a launched kernel that no ``aot_launches`` declares."""
    covered = {lc.name for lc in launches}
    bare = sorted(set(launched_kernels(modules)) - covered)
    if bare:
        raise LookupError(f"kernels without declared launches: {', '.join(bare)}; their modules must "
                          "define aot_launches() (see orca_lab/kernels/aot.py)")


# -------------------------------------------------------------------------------------- compile
def compile_launch(lc: Launch, arch: int) -> dict:
    """Compile ``lc`` to a cubin for ``sm_<arch>``; its shared memory against the device's limit."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = {"kernel": lc.name, "what": lc.what, "arch": arch, "device": DEVICES.get(arch, f"sm_{arch}"),
           "constexprs": {k: str(v) for k, v in lc.constexprs.items()}, "signature": lc.signature,
           "divisible_by_16": [lc.kernel.arg_names[i] for (i,) in sorted(lc.attrs)], "quick": lc.quick}
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(lc.kernel, lc.signature, lc.constexprs, lc.attrs),
                                  target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": lc.num_warps, "num_stages": lc.num_stages})
    except Exception as e:  # the compiler's own message says what is wrong with the kernel
        return {**row, "error": f"{type(e).__name__}: {str(e).strip()[-1500:]}"}
    md = compiled.metadata
    limit = SHARED_LIMITS.get(arch)
    row.update(shared=md.shared, shared_limit=limit, num_warps=md.num_warps, num_stages=md.num_stages,
               cubin_bytes=len(compiled.asm["cubin"]), in_flight=copies_in_flight(compiled.asm["ttgir"]),
               **resources(compiled.asm["cubin"]), seconds=round(time.perf_counter() - t0, 3))
    if limit is not None and md.shared > limit:
        row["error"] = f"needs {md.shared} bytes of shared memory, {row['device']} allows {limit} per block"
    return row


def copies_in_flight(ttgir: str) -> int:
    """The most asynchronous copies a wait leaves in flight: how far ahead the software pipeline
    (``num_stages``) loads a loop's tiles. 0: every copy is waited for before the next step's compute
    starts, so its latency is not hidden (or the kernel copies nothing asynchronously). Copies into
    shared memory by pointers (cp.async) are waited for by count; the Tensor Memory Accelerator's
    wait on barriers, so theirs are the copies the first loop's prologue issues beyond one step's."""
    waits = max((int(n) for n in re.findall(r"async_wait\b[^\n]*?\{num = (\d+)", ttgir)), default=0)
    head, _, loop = ttgir.partition("scf.for")
    tma = "ttng.async_tma_copy_global_to_local"
    return max(waits, head.count(tma) - loop.split("scf.yield")[0].count(tma))


def resources(cubin: bytes) -> dict:
    """Registers per thread and stack bytes (where spilled registers go) from ``cuobjdump``, which
    ships in Triton's wheel beside ptxas; empty where it does not."""
    import subprocess
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(tool, os.X_OK):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"registers": int(found[1]), "stack_bytes": int(found[2])} if found else {}


_JOBS: list = []


def _compile_job(i: int) -> dict:
    return compile_launch(*_JOBS[i])


def compile_all(launches, archs, jobs: int = 1, done=None) -> list[dict]:
    """Every launch for every arch, in ``jobs`` forked processes (no GPU here, so forking is safe);
    ``done(rows)`` after each compile, so a run cut short keeps what it finished."""
    _JOBS[:] = [(lc, arch) for arch in archs for lc in launches if arch >= lc.min_arch]
    done = done or (lambda rows: None)
    rows = []
    if jobs <= 1 or len(_JOBS) < 2:
        for i in range(len(_JOBS)):
            rows.append(_compile_job(i))
            done(rows)
        return rows
    import multiprocessing as mp
    with mp.get_context("fork").Pool(jobs) as pool:
        for row in pool.imap(_compile_job, range(len(_JOBS)), chunksize=1):
            rows.append(row)
            done(rows)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--targets", type=int, nargs="+", default=list(DEFAULT_TARGETS),
                   help="compute capabilities, e.g. 80 90")
    p.add_argument("--modules", nargs="+", help="kernel modules (default: all of orca_lab.kernels)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiling processes")
    p.add_argument("--full", action="store_true",
                   help="every declared launch (default: the quick set that CI compiles)")
    p.add_argument("--json", help="write every compile's row here")
    p.add_argument("--list", action="store_true", help="write the declared launches to --json, compile none")
    p.add_argument("--match", help="only the launches whose description matches this regular expression")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("TRITON_INTERPRET is on: interpreted kernels cannot be compiled; run with TRITON_INTERPRET=0")
    t0 = time.perf_counter()
    modules = kernel_modules(args.modules)
    declared = declared_launches(modules)
    try:
        check_coverage(modules, declared)
    except LookupError as e:
        print(f"error: {e}")
        return 2
    launches = declared if args.full else ci_subset(declared)
    if args.match:
        launches = [lc for lc in launches if re.search(args.match, lc.what)]
    if args.list:               # "ci": in CI's subset, whatever --full and --match chose to compile
        chosen = {id(lc) for lc in ci_subset(declared)}
        picked = len(launches) if args.full or args.match else None
        rows = [{"kernel": lc.name, "what": lc.what, "num_warps": lc.num_warps, "num_stages": lc.num_stages,
                 "constexprs": {k: str(v) for k, v in lc.constexprs.items()}, "signature": lc.signature,
                 "divisible_by_16": [lc.kernel.arg_names[i] for (i,) in sorted(lc.attrs)], "ci": id(lc) in chosen,
                 "min_arch": lc.min_arch}
                for lc in declared]
        _write(args.json, rows)
        print(f"{len(declared)} distinct launches declared, {len(chosen)} in CI's subset"
              + (f", {picked} chosen by --full / --match" if picked is not None else ""))
        return 0
    n_all = sum(arch >= lc.min_arch for arch in args.targets for lc in launches)

    def progress(rows):      # every 100 compiles: a line, and the JSON so far (a cut run keeps them)
        if len(rows) % 100 == 0 or len(rows) == n_all:
            print(f"{len(rows)} of {n_all} compiles, {sum('error' in r for r in rows)} failed, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            _write(args.json, rows)
    rows = compile_all(launches, args.targets, args.jobs, progress)
    failed = [r for r in rows if "error" in r]
    for arch in args.targets:
        ok = [r for r in rows if r["arch"] == arch and "error" not in r]
        worst = max(ok, key=lambda r: r["shared"], default=None)
        peak = f"; most shared memory {worst['shared']} B ({worst['kernel']}, {worst['what']})" if worst else ""
        spilled = sum(r.get("stack_bytes", 0) > 0 for r in ok)
        peak += f"; {spilled} spill registers to the stack" if spilled else ""
        n = sum(arch >= lc.min_arch for lc in launches)
        print(f"{DEVICES.get(arch, arch)}: {len(ok)} of {n} launches compiled{peak}")
    for r in failed:
        print(f"FAILED {r['kernel']} [{r['what']}] for {r['device']}: {r['error']}")
    which = "all" if args.full else "CI's subset (--full: all)"
    print(f"{len(launches)} of {len(declared)} distinct launches ({which}) of {len(launched_kernels(modules))} "
          f"kernels, {len(rows)} compiles in {time.perf_counter() - t0:.1f} s")
    _write(args.json, rows)
    return 1 if failed else 0


def _write(path, rows):
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

