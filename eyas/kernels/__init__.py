"""Native CPU kernels: small C files built on first use by the system C compiler, cached, loaded with ctypes.

A kernel is built once per (source with the headers beside it, compiler flags, CPU) into ``<cache_dir>/kernels/<name>-<hash>.so``
and reloaded from there afterwards (building takes 2-3 s on the project's CPU). It is built for this CPU
(``-march=native``) with OpenMP; the library asks for ``libgomp.so.1`` by name, which resolves to
the copy PyTorch has already loaded, so kernels and PyTorch share one thread pool. When no
compiler is found or the build fails, ``load`` (and ``entry``) return None and say why once in
the log; callers then take a pure-PyTorch path.

A kernel written for several instruction sets (``quant_gemm.c``) is instead built once per
instruction set, with explicit flags, and the build for the best set this CPU has is loaded
(``cpu_isa``); ``EYAS_CPU_ISA=avx512|avx2|portable`` forces one the CPU supports (tests use it).
Such a kernel may also have variants (``VARIANTS``): a separate build of the same source with a macro and
the instructions it needs, e.g. ``quant_gemm.c``'s bfloat16 products or ``q8_gemm.c``'s VNNI dot products.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

from eyas.cache import cache_dir

logger = logging.getLogger("eyas")
_SOURCES = Path(__file__).parent
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"])  # the second for compilers without -march=native
# instruction set -> (the /proc/cpuinfo flags it needs, compiler flags), best first
ISA_BUILDS = {
    "avx512": (("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"),
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"]),
    "avx2": (("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
    "portable": ((), []),
}
# variant -> (the kernel it builds, the instruction set it builds on, the /proc/cpuinfo flags it needs besides,
# compiler flags). quant_gemm.c's is an arithmetic variant (another matmul precision); q8_gemm.c's are the same
# arithmetic with the integer dot-product instructions (vpdpbusd; "amx": also tdpbssd tiles for 16 rows and
# more), which the engine takes wherever they run, the first one listed that runs.
VARIANTS = {
    "bf16_products": ("quant_gemm", "avx512", ("avx512_bf16",), ["-mavx512bf16", "-DEYAS_BF16_PRODUCTS"]),
    "amx": ("q8_gemm", "avx512", ("avx512_vnni", "amx_tile", "amx_int8"),
            ["-mavx512vnni", "-DEYAS_VNNI512", "-mamx-tile", "-mamx-int8", "-DEYAS_AMX"]),
    "vnni512": ("q8_gemm", "avx512", ("avx512_vnni",), ["-mavx512vnni", "-DEYAS_VNNI512"]),
    "vnni256": ("q8_gemm", "avx2", ("avx_vnni",), ["-mavxvnni", "-DEYAS_VNNI256"]),
}


@functools.cache  # read once a process: the kernels' lookups ask for the flags a few hundred times at load
def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(lines))  # one copy per distinct line, not one per core


def cpu_key() -> str:
    """A short key of this CPU (its model name and flags), for what is measured once per CPU."""
    return hashlib.sha256((platform.machine() + _cpu_id()).encode()).hexdigest()[:16]


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    for line in _cpu_id().splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def supported_isas() -> tuple[str, ...]:
    """The instruction sets of ``ISA_BUILDS`` this CPU runs, best first."""
    flags = cpu_flags()
    return tuple(isa for isa, (needs, _) in ISA_BUILDS.items() if all(f in flags for f in needs))


def cpu_isa() -> str:
    """The instruction set multi-ISA kernels are built for: ``EYAS_CPU_ISA`` if set, else the best supported."""
    supported = supported_isas()
    forced = os.environ.get("EYAS_CPU_ISA")
    if forced:
        if forced not in supported:
            raise ValueError(f"EYAS_CPU_ISA={forced!r}: this CPU runs {', '.join(supported)} "
                             f"(known: {', '.join(ISA_BUILDS)})")
        return forced
    return supported[0]


def _build(source: Path, cc: str, flags: list[str]) -> Path | None:
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(_SOURCES.glob("*.h")))  # headers it may include
    key = hashlib.sha256(text + " ".join([cc, *flags, platform.machine(), _cpu_id()]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # built aside, then moved: racing builds are safe
    os.close(fd)
    result = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", tmp, str(source), "-lm"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        logger.debug("building %s with %s %s failed:\n%s", source.name, cc, " ".join(flags), result.stderr)
        return None
    os.replace(tmp, target)
    return target


def variant_supported(variant: str) -> bool:
    """Whether this CPU runs the variant's build (its instruction set is ``cpu_isa()`` and its flags are there)."""
    _, isa, needs, _ = VARIANTS[variant]
    return cpu_isa() == isa and all(f in cpu_flags() for f in needs)


def dot_variant(name: str) -> str | None:
    """The integer dot-product variant of kernel ``name`` that runs here (``amx``, ``vnni512``, ``vnni256``), or
    None: the first one in ``VARIANTS`` whose instructions the CPU has and the compiler knows (GCC before 11 has
    no ``-mamx-int8``: an AMX CPU then runs ``vnni512``)."""
    cc, _ = _compiler()
    return next((v for v, (kernel, isa, *_) in VARIANTS.items() if kernel == name and variant_supported(v)
                 and (cc is None or _library(name, cc, isa, v) is not None)), None)


def _compiler() -> tuple[str | None, list[str]]:
    """(the C compiler's path or None, the names looked for): ``CC``, else cc or gcc."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc"]
    return next((found for c in candidates if (found := shutil.which(c))), None), candidates


def _library(name: str, cc: str, isa: str | None, variant: str | None) -> Path | None:
    """The built library of ``load``'s arguments, built now if the cache lacks it; None if no build succeeds."""
    extra = [] if variant is None else VARIANTS[variant][3]
    assert variant is None or VARIANTS[variant][:2] == (name, isa), (name, variant, isa)
    flag_sets = _FLAG_SETS if isa is None else [["-O3", *ISA_BUILDS[isa][1], *extra, "-fopenmp"]]
    return next((path for flags in flag_sets if (path := _build(_SOURCES / f"{name}.c", cc, flags))), None)


@functools.cache
def load(name: str, isa: str | None = None, variant: str | None = None) -> ctypes.CDLL | None:
    """The kernel library ``eyas/kernels/<name>.c``, built if needed; None if it cannot be built.

    With ``isa`` (a key of ``ISA_BUILDS``), it is built for that instruction set instead of ``-march=native``;
    with ``variant`` (a key of ``VARIANTS``, whose instruction set ``isa`` must be), also with its flags."""
    import torch  # noqa: F401  (PyTorch's libgomp must be loaded first, so the kernel's OpenMP binds to it)

    cc, candidates = _compiler()
    if cc is None:
        logger.warning("no C compiler (%s) found: the native %s kernel is off, PyTorch ops are used instead",
                       " or ".join(candidates), name)
        return None
    path = _library(name, cc, isa, variant)
    if path is not None:
        return ctypes.CDLL(str(path))
    logger.warning("%s could not build the native %s kernel (rerun with logging at DEBUG for the compiler's "
                   "output): PyTorch ops are used instead", cc, name)
    return None


PER_ISA = ("quant_gemm", "q8_gemm")  # the kernels loaded per instruction set (``cpu_isa``); the others: -march=native


def _arithmetic_variants() -> list[str]:
    """quant_gemm.c's variants this CPU runs (other matmul precisions; one engine loads at most one of them)."""
    return [v for v in VARIANTS if VARIANTS[v][0] == "quant_gemm" and variant_supported(v)]


def _native_kernels() -> list[str]:
    """The kernels built for ``-march=native`` (not per instruction set), by name."""
    return [path.stem for path in sorted(_SOURCES.glob("*.c")) if path.stem not in PER_ISA]


def engine_builds() -> list[tuple[str, str | None, str | None]]:
    """``load``'s arguments for every kernel an engine on this CPU may load, the slowest builds first."""
    isa = cpu_isa()
    per_isa = [("quant_gemm", isa, variant) for variant in (None, *_arithmetic_variants())]
    per_isa.append(("q8_gemm", isa, dot_variant("q8_gemm")))
    return per_isa + [(name, None, None) for name in _native_kernels()]


def builds_key() -> str:
    """A short key of the kernels an engine on this CPU runs (their sources and headers, and which builds it
    takes), for what is measured of them once: a changed kernel or build is measured anew."""
    text = b"".join(p.read_bytes() for p in sorted(_SOURCES.glob("*.[ch]"))) + repr(engine_builds()).encode()
    return hashlib.sha256(text + cpu_key().encode()).hexdigest()[:16]


class Builds:
    """The variant builds of ``building``, which start as its block ends, so an engine that learns it will not load
    one can leave it out first."""

    def __init__(self, variants: dict[str, Callable[[], object]]):
        self.variants = variants  # variant -> its build

    def skip(self, variant: str) -> None:
        """Leave out the build of ``variant`` (a key of ``VARIANTS``): the engine will not load it (a later ``load``
        would build it then)."""
        self.variants.pop(variant, None)


@contextlib.contextmanager
def building() -> Iterator[Builds | None]:
    """Build every kernel of ``engine_builds`` that the cache lacks, side by side on the CPU's cores, while the
    block runs (an engine resolving its model: a GGUF's first conversion, about 5 s for the default model, runs
    beside the builds); leaving the block waits for them. The block gets the ``Builds`` (None without a C
    compiler), whose variant builds start as the block ends, so an engine that learns it will not run one can
    leave it out. An engine's first run otherwise builds them one by one as it loads them (AMD Zen 4, 2 cores: 22 s of builds,
    against 11 s side by side). Nothing is loaded; a build that fails fails again when its kernel is loaded, and
    says why there. Leaving the block by an exception cancels the builds not yet started (the error is not held
    up; the ones running finish in the background)."""
    cc, _ = _compiler()
    if cc is None:
        yield None
        return
    isa = cpu_isa()

    def q8_gemm() -> None:  # the dot-product variant that runs here (dot_variant builds it), else the plain build
        _library("q8_gemm", cc, isa, dot_variant("q8_gemm"))

    native = sorted(_native_kernels(), key=lambda name: -(_SOURCES / f"{name}.c").stat().st_size)  # largest first
    jobs = [functools.partial(_library, "quant_gemm", cc, isa, None), q8_gemm,
            *(functools.partial(_library, name, cc, None, None) for name in native)]
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    for job in jobs:  # engine_builds' libraries but the variants, which wait for the block's end
        pool.submit(job)
    builds = Builds({v: functools.partial(_library, "quant_gemm", cc, isa, v) for v in _arithmetic_variants()})
    try:
        yield builds
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    for job in builds.variants.values():
        pool.submit(job)
    pool.shutdown(wait=True)


def entry(name: str, *argtypes, function: str | None = None, isa: str | None = None,
          variant: str | None = None) -> ctypes._CFuncPtr | None:
    """The C function ``eyas_<function or name>`` of ``eyas/kernels/<name>.c``, returning int and
    taking ``argtypes`` (ctypes types); None if the kernel cannot be built. ``isa``, ``variant``: as for ``load``."""
    lib = load(name, isa, variant)
    if lib is None:
        return None
    fn = getattr(lib, f"eyas_{function or name}")
    fn.restype = ctypes.c_int
    fn.argtypes = list(argtypes)
    return fn


def bf16_mac_ratio() -> float | None:
    """Multiply-adds per second of one core's bfloat16 dot products (``vdpbf16ps``) over its float32 FMAs, or None
    where the ``bf16_products`` build does not run. AMD Zen 4 issues both at one rate, so 2.0; an earlier
    measurement on Intel Sapphire Rapids found vdpbf16ps at a quarter of the FMA rate, 0.5. Timed once per CPU
    (about 30 ms: the best of 5 alternating runs of ``quant_gemm.c``'s probe) and kept in the cache folder, so
    every process on a machine makes the same choice from it."""
    if not variant_supported("bf16_products"):
        return None
    record = cache_dir() / "kernels" / f"mac-ratio-{cpu_key()}.txt"
    try:
        return float(record.read_text())
    except (OSError, ValueError):
        pass
    probe = entry("quant_gemm", ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, function="mac_probe", isa="avx512",
                  variant="bf16_products")
    if probe is None:
        return None
    sink, best = ctypes.c_float(), {1: float("inf"), 0: float("inf")}
    for _ in range(5):
        for bf16 in best:
            start = time.perf_counter()
            probe(bf16, 1_000_000, ctypes.byref(sink))
            best[bf16] = min(best[bf16], time.perf_counter() - start)
    ratio = round(2 * best[0] / best[1], 3)  # 32 multiply-adds an instruction against 16
    record.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=record.parent)
    with os.fdopen(fd, "w") as f:
        f.write(f"{ratio:.3f}")
    os.replace(tmp, record)
    return ratio
