"""Compile the native CPU kernels on first use and load them with ctypes.

The shared library is built from every ``csrc/*.cpp`` (one file per kernel family, each with
its own C API block; shared helpers in ``csrc/common.h``) with the system C++ compiler
(``$CXX``, else g++/c++/clang++) for this CPU (``-march=native``: AVX-512, AVX2 or portable code
paths by what the CPU has) and cached under
``~/.cache/pagedllm/kernels`` keyed by the sources, the flags and the CPU, so later starts load it in milliseconds. It links the OpenMP runtime
torch already loaded (same soname), so kernel threads and torch's threads are one pool.

When there is no compiler or the build fails, ``load_kernels()`` returns None and every
caller falls back to its pure-torch path; ``PAGEDLLM_NATIVE_KERNELS=0`` forces that.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from pagedllm.envs import env_flag


logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"


def sources() -> list[Path]:
    """Every kernel source file, in a fixed order."""
    return sorted(CSRC.glob("*.cpp"))


def headers() -> list[Path]:
    return sorted(CSRC.glob("*.h"))
# No -ffast-math: GCC links crtfastmath.o for it, which turns on flush-to-zero and
# denormals-are-zero for the whole process (torch and numpy included). The kernels' hot loops
# use intrinsics or `omp simd` reductions, so they vectorise without it.
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]

_C_TYPES = {
    "void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
    "float": ctypes.c_float, "double": ctypes.c_double, "const char*": ctypes.c_char_p,
}  # fmt: skip


def _c_type(decl: str):
    """ctypes type of a C declaration's type part ("const float*" -> c_void_p, "int64_t" -> c_int64)."""
    decl = " ".join(decl.replace("*", " * ").split())
    if decl == "const char *":
        return ctypes.c_char_p
    if "*" in decl:
        return ctypes.c_void_p
    return _C_TYPES[decl.removeprefix("const ")]


def c_api(source: str) -> dict[str, tuple[object, list[object]]]:
    """name -> (restype, argtypes) of every prototype between C-API-BEGIN and C-API-END in a
    kernel source file or header: the one place its part of the C API is written down."""
    if "// C-API-BEGIN" not in source:
        return {}
    block = source.split("// C-API-BEGIN", 1)[1].split("// C-API-END", 1)[0]
    body = block.split("{", 1)[1].rsplit("}", 1)[0]
    api = {}
    for proto in filter(None, (" ".join(p.split()) for p in body.split(";"))):
        m = re.fullmatch(r"(.+?)\s*\b(\w+)\((.*)\)", proto)
        if m is None:
            raise RuntimeError(f"cannot read the C API prototype {proto!r}")
        ret, name, params = m.groups()
        args = [p.strip() for p in params.split(",") if p.strip()]
        api[name] = (_c_type(ret.strip()), [_c_type(re.sub(r"\s*\b\w+$", "", a)) for a in args])
    return api


def full_c_api() -> dict[str, tuple[object, list[object]]]:
    """The C API of all source files and headers together (the core kernels' is kernels.h); a
    name declared twice is an error."""
    api: dict[str, tuple[object, list[object]]] = {}
    for f in [*sources(), *headers()]:
        part = c_api(f.read_text())
        twice = api.keys() & part.keys()
        if twice:
            raise RuntimeError(f"{f.name} declares {sorted(twice)} again")
        api.update(part)
    return api


def _cache_dir() -> Path:
    """$PAGEDLLM_CACHE_DIR/kernels (default ~/.cache/pagedllm/kernels), as ``config.cache_dir``:
    the kernels import nothing else of pagedllm."""
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm") / "kernels"


def _cpuinfo_line(field: str) -> str | None:
    """The first /proc/cpuinfo line of ``field`` (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(field)), None)
    except OSError:
        return None


def _cpu_signature() -> str:
    return _cpuinfo_line("flags") or platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str, flags: list[str], out: Path) -> None:
    """Compile every source to an object file, all at once (one per core; the GEMM file alone
    takes ~8 s of the ~18 s), then link them."""
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename, so concurrent processes never load a partial file.
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        objects, jobs = [], []
        compile_flags = [f for f in flags if f != "-shared"]
        for src in sources():
            obj = Path(work) / f"{src.stem}.o"
            objects.append(obj)
            cmd = [compiler, *compile_flags, "-c", str(src), "-o", str(obj)]
            while sum(p.poll() is None for _, p in jobs) >= len(os.sched_getaffinity(0)):
                time.sleep(0.05)
            jobs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        link = [compiler, *flags, *map(str, objects), "-o", str(Path(work) / out.name)]
        for cmd, proc in jobs:
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
        done = subprocess.run(link, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(link)} failed:\n{done.stderr[-2000:]}")
        os.replace(Path(work) / out.name, out)


def library_path(march: str = "native", defines: tuple[str, ...] = ()) -> Path:
    """The library built for ``-march=march`` (built now unless cached), without loading it:
    a library for an instruction set this CPU lacks can still be built and inspected.
    ``defines``: preprocessor macros for test builds (``PAGEDLLM_AMX_EMULATE``: the AMX path
    over a scalar model of its instructions). Raises RuntimeError when it cannot be built."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (looked for $CXX, g++, c++, clang++)")
    flags = [f"-march={march}", *FLAGS, *(f"-D{d}" for d in defines)]
    if env_flag("PAGEDLLM_KERNEL_DEBUG", False):  # every index checked in the kernels
        flags.append("-DPAGEDLLM_DEBUG")
    code = b"".join(f.name.encode() + f.read_bytes() for f in [*sources(), *headers()])
    key = hashlib.sha256(code + " ".join([compiler, *flags]).encode() + _cpu_signature().encode()).hexdigest()[:16]
    path = _cache_dir() / f"cpu_kernels-{key}.so"
    if not path.exists():
        logger.info("building native CPU kernels with %s -march=%s (once per machine)", compiler, march)
        _build(compiler, flags, path)
    return path


def build_library(march: str = "native", defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (or find in the cache) and load the library for ``-march=march``.

    ``native`` is what the engine uses: the compiler reads this CPU's features, so the AVX-512
    paths are compiled in where the CPU has AVX-512, the AVX2 ones where it has AVX2, else the
    portable ones (``pagedllm_kernels_isa()`` says which). Tests also build ``x86-64`` and
    ``haswell`` to run the other paths, and ``native`` with ``defines`` for the emulated AMX
    path. Raises RuntimeError/OSError when it cannot.
    """
    import torch  # noqa: F401  (its OpenMP runtime must be loaded before our library)

    lib = ctypes.CDLL(str(library_path(march, defines)))
    for name, (restype, argtypes) in full_c_api().items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@functools.cache
def load_kernels() -> ctypes.CDLL | None:
    """The kernel library for this CPU, built if needed; None when it cannot be had."""
    if not env_flag("PAGEDLLM_NATIVE_KERNELS", True):
        logger.info("native kernels disabled by PAGEDLLM_NATIVE_KERNELS")
        return None
    try:
        lib = build_library()
    except (OSError, RuntimeError) as e:
        logger.warning("native kernels unavailable, using the pure-torch kernels (slower): %s", e)
        return None
    isa = lib.pagedllm_kernels_isa().decode()
    lib.pagedllm_set_wide_fma(int(_wide_fma(isa)))
    logger.info("native CPU kernels loaded (%s%s)", isa, ", tiles for full-width 512-bit FMAs" if lib.pagedllm_wide_fma() else "")
    return lib


def _wide_fma(isa: str) -> bool:
    """Whether the AVX-512 kernels take the tile shapes for cores with two full-width 512-bit FMA
    units (cpu_kernels.cpp: g_wide_fma). Measured faster on an Intel Xeon; AMD Zen 4 splits
    512-bit ops in halves and was measured with the other shapes, so on for Intel only.
    ``PAGEDLLM_WIDE_FMA=0/1`` overrides. The bits are the same either way."""
    return env_flag("PAGEDLLM_WIDE_FMA", isa == "avx512" and "GenuineIntel" in (_cpuinfo_line("vendor_id") or ""))
