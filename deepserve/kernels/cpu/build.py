"""Compile a C source into a shared library once, and cache it.

The library's file name carries a hash of everything that shapes the binary (source, flags, compiler,
CPU: -march=native makes it CPU-specific), so a stale or foreign build is never picked up. A build goes
to a temporary file in the cache directory and is renamed into place, which is atomic: processes that
build at the same time (pytest-xdist workers) each rename a complete file over the other's.
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

from deepserve import envs

logger = logging.getLogger(__name__)

# No -ffast-math: sums must keep their written order (results stay bitwise reproducible) and libm stays exact.
BASE_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11"]
OPENMP_FLAGS = ["-fopenmp"]


def cache_dir() -> Path:
    return envs.DEEPSERVE_CACHE_DIR


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.lru_cache(maxsize=None)
def _compiler_identity(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.lru_cache(maxsize=None)
def _cpu_identity() -> str:
    """Model name and feature flags of this CPU (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join([platform.machine(), platform.processor(), *keep])


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_text(source: Path, seen: frozenset[Path] = frozenset()) -> str:
    """The source and, recursively, every file it includes by a quoted name from its own directory: a change in an
    included kernel (llama_decode.c includes gguf_linear.c) must give a new library, not the stale cached one."""
    text = source.read_text()
    parts = [text]
    for name in _LOCAL_INCLUDE.findall(text):
        path = (source.parent / name).resolve()
        if path.is_file() and path not in seen:
            parts.append(source_text(path, seen | {path}))
    return "\0".join(parts)


def library_path(source: Path, flags: list[str], compiler: str, directory: Path) -> Path:
    key = hashlib.sha256("\0".join([source_text(source), " ".join(flags), compiler, _compiler_identity(compiler),
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    return directory / f"{source.stem}-{key}.so"


def compile_library(compiler: str, source: Path, flags: list[str], target: Path) -> None:
    """Compile into a temporary file beside `target`, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so")
    os.close(fd)
    try:
        t0 = time.perf_counter()
        subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=300)
        os.replace(tmp, target)
        logger.info("compiled %s in %.1f s: %s", source.name, time.perf_counter() - t0, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(source: Path, directory: Path | None = None, defines: tuple[str, ...] = ()) -> Path | None:
    """Path of the compiled library (built now unless a matching one is cached), or None when it cannot be
    built. Tries OpenMP first, then a single-threaded build (a compiler without OpenMP support). `defines`
    (e.g. "KV_BF16") select a variant of the source: each is its own cached library."""
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C compiler found (cc, gcc, $CC): using the PyTorch path for %s", source.name)
        return None
    directory = directory or cache_dir()
    extra = [f"-D{d}" for d in defines]
    variants = [(flags, library_path(source, flags, compiler, directory))
                for flags in (BASE_FLAGS + OPENMP_FLAGS + extra, BASE_FLAGS + extra)]
    for _, target in variants:   # a cached build of any variant: no compiler run (not even a failing one)
        if target.exists():
            return target
    errors = []
    for flags, target in variants:
        try:
            compile_library(compiler, source, flags, target)
            return target
        except subprocess.CalledProcessError as e:
            errors.append(e.stderr.strip()[-2000:])
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(repr(e))
    logger.warning("building %s failed, using the PyTorch path instead:\n%s", source.name, "\n".join(errors))
    return None


def load(source: Path, signatures: dict[str, list], defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """Build (or find) and load `source` (with `defines`), declaring each function's argument types (all
    return void). None, with one warning, when it cannot be built or loaded: callers then use their PyTorch
    path."""
    path = build(source, defines=defines)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning("loading %s failed, using the PyTorch path instead: %s", path, e)
        return None
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib
