"""Native Hopper kernels: CUDA C++ under ``flashdsa/runtime/<op>/cuda/``, built on first use.

Each op folder's ``cuda/`` directory is one extension: its ``.cu`` files hold the kernels and a
host launcher (CUDA only, no torch headers, so they compile anywhere nvcc runs), its ``.cpp``
files check the tensors and register the launchers as ``torch.ops.flashdsa.*``. The first
:func:`load` in a process builds the extension with ninja through ``torch.utils.cpp_extension``
for sm_90a into a cache directory named by a hash of the sources, flags and toolchain, so a build
runs once per machine and a change of any source builds afresh. A killed compile leaves
cpp_extension's ``lock`` file behind, which makes every later build wait forever; builds here
hold an OS file lock (released when its process dies) and, holding it, remove such a stale lock.

The CUDA toolchain is found from ``CUDA_HOME``/``CUDA_PATH``, ``nvcc`` on PATH, the
``nvidia-cuda-nvcc`` wheel (``pip install 'flashdsa[nvcc]'``) or ``/usr/local/cuda``; CuTe and
CUTLASS headers come from the ``nvidia-cutlass`` wheel when it is installed. Without nvcc the
``cuda`` backend is unavailable and dispatch says so. :func:`compile_check` compiles every source
without linking (no GPU, no CUDA torch needed) and returns ptxas's register, spill and shared
memory report: CI runs it.

The extension links against the ``libstdc++`` this process already runs (torch's). A compiler that
links ``libstdc++`` statically by default (the GPU image's ``CXX=/opt/gcc/bin/g++`` does) would
otherwise give the extension a private copy whose stream locale is never initialized, so the first
``TORCH_CHECK`` message that formats a number crashed the process (SIGSEGV) instead of raising.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

logger = logging.getLogger(__name__)

RUNTIME = Path(__file__).resolve().parent
CACHE_ENV = "FLASHDSA_CACHE_DIR"  # else TORCH_EXTENSIONS_DIR, else ~/.cache/flashdsa/kernels
ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]
NVCC_FLAGS = ["-O3", "-lineinfo", "--expt-relaxed-constexpr", *ARCH_FLAGS]
NVCC_STD = "-std=c++17"  # the .cu files include no torch header
SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
SHARED_INCLUDE = "cuda_include"  # runtime/<this>/: headers every extension's kernels and ops may include


class NativeBuildError(ImportError):
    """A native extension cannot be built: no toolchain, or a compile error. An ImportError, so
    dispatch treats the backend as unavailable. ``output`` holds the compiler's whole output."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


@dataclass(frozen=True)
class Extension:
    """One op folder's native kernels: ``flashdsa/runtime/<op>/cuda/*``."""

    op: str

    @property
    def name(self) -> str:
        return f"flashdsa_{self.op}"

    @property
    def directory(self) -> Path:
        return RUNTIME / self.op / "cuda"

    def files(self, *suffixes: str) -> list[Path]:
        return sorted(p for p in self.directory.iterdir() if p.suffix in (suffixes or SOURCE_SUFFIXES))


def extensions() -> list[Extension]:
    """Every op folder with native kernels."""
    return [Extension(d.parent.name) for d in sorted(RUNTIME.glob("*/cuda")) if any(d.glob("*.cu"))]


def _is_toolkit(home: Optional[str | Path]) -> bool:
    """``home`` holds nvcc and the runtime headers (``/usr/local`` with a wrapper script in bin does not)."""
    return home is not None and all((Path(home) / p).is_file() for p in ("bin/nvcc", "include/cuda_runtime.h"))


@functools.cache
def cuda_home() -> Optional[Path]:
    """The CUDA toolkit holding ``bin/nvcc`` and its headers, or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    candidates.append(str(Path(nvcc).resolve().parents[1]) if nvcc else None)
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(str(p.parents[1]) for p in Path(root).glob("cu*/bin/nvcc"))
    candidates.append("/usr/local/cuda")
    return next((Path(c) for c in candidates if _is_toolkit(c)), None)


def missing_nvcc() -> Optional[str]:
    """Why native kernels cannot be compiled here, or None."""
    if cuda_home() is None:
        return "nvcc not found: set CUDA_HOME, or pip install 'flashdsa[nvcc]'"
    return None


def unavailable() -> Optional[str]:
    """Why native kernels cannot be built and loaded here, or None."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    return missing_nvcc()


def cutlass_include() -> Optional[Path]:
    """The CuTe/CUTLASS headers of the ``nvidia-cutlass`` wheel, or None when it is not installed."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or spec.origin is None:
        return None
    include = Path(spec.origin).parent / "source" / "include"
    return include if include.is_dir() else None


def _cuda_includes(home: Path) -> list[str]:
    """The toolkit's headers (a wheel keeps CCCL's cub/thrust/cuda:: under include/cccl), CuTe's and
    the extensions' shared ones."""
    paths = [home / "include", home / "include" / "cccl", cutlass_include(), RUNTIME / SHARED_INCLUDE]
    return [str(p) for p in paths if p is not None and p.is_dir()]


def loaded_libstdcxx() -> Optional[str]:
    """The ``libstdc++.so`` mapped into this process (torch's C++ runtime), or None."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = (line.split(maxsplit=5)[-1] for line in maps if "/libstdc++.so" in line)
    return next((path for path in paths if Path(path).is_file()), None)


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV) or os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "flashdsa" / "kernels"


def shared_headers() -> list[Path]:
    """The headers of ``runtime/cuda_include/`` (device ``.cuh``, host ``.h``), which every
    extension's kernels and ops may include."""
    directory = RUNTIME / SHARED_INCLUDE
    return sorted(p for p in directory.iterdir() if p.suffix in (".cuh", ".h")) if directory.is_dir() else []


def build_directory(ext: Extension, home: Path) -> Path:
    """``<cache>/<name>-<hash>``: the hash covers the sources and the shared headers, flags, torch
    and the toolkit path."""
    digest = hashlib.sha256()
    for path in [*ext.files(), *shared_headers()]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join([*NVCC_FLAGS, *_link_flags(), torch.__version__, str(torch.version.cuda), str(home)]).encode())
    return cache_root() / f"{ext.name}-{digest.hexdigest()[:16]}"


def _link_flags() -> list[str]:
    """Link the C++ runtime torch runs on by its path, ahead of whatever the compiler adds by default."""
    runtime = loaded_libstdcxx()
    return [runtime] if runtime else []


@contextmanager
def exclusive(directory: Path) -> Iterator[None]:
    """Hold ``<directory>.flock`` (the OS drops it when its holder dies) and, holding it, remove
    cpp_extension's ``lock`` file that a killed build left behind."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(f"{directory}.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing the stale build lock %s (a killed compile left it)", stale)
            stale.unlink()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _first_error(output: str) -> str:
    """The compiler's or linker's first complaint in ``output`` (not ninja's command lines)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    complaint = re.compile(r"error:|cannot find|undefined reference|fatal")
    return next((line for line in lines if complaint.search(line) and not line.startswith("Error building")),
                lines[-1] if lines else "no output")


def build(ext: Extension) -> Path:
    """Build ``ext`` (or find it built) and load it into torch.ops; returns its build directory."""
    reason = unavailable()
    if reason is not None:
        raise NativeBuildError(f"cannot build {ext.name}: {reason}")
    from torch.utils import cpp_extension

    home = cuda_home()
    if cpp_extension.CUDA_HOME is None:  # torch found no toolkit at import (e.g. nvcc from the wheel only)
        cpp_extension.CUDA_HOME = str(home)
    directory = build_directory(ext, home)
    logger.info("loading native kernels %s from %s (built on first use, about a minute)", ext.name, directory)
    with exclusive(directory):
        try:
            cpp_extension.load(name=ext.name, sources=[str(p) for p in ext.files(".cu", ".cpp")],
                               extra_cuda_cflags=NVCC_FLAGS, extra_ldflags=_link_flags(),
                               extra_include_paths=_cuda_includes(home), build_directory=str(directory),
                               is_python_module=False,
                               verbose=logger.isEnabledFor(logging.DEBUG))
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            output = str(e) + str(getattr(e, "output", "") or "")
            raise NativeBuildError(f"building {ext.name} failed: {_first_error(output)}", output) from None
    return directory


_loaded: dict[str, Path | NativeBuildError] = {}  # op -> build directory, or why it failed (built once per process)


def load(op: str) -> None:
    """Make ``torch.ops.flashdsa``'s kernels of ``op`` callable, building them on first use; a failed
    build is remembered and raised again without rebuilding."""
    if op not in _loaded:
        try:
            _loaded[op] = build(Extension(op))
        except NativeBuildError as e:
            _loaded[op] = e
    if isinstance(_loaded[op], NativeBuildError):
        raise _loaded[op]


def _run(command: list[str], source: Path) -> str:
    run = subprocess.run(command, capture_output=True, text=True)
    output = run.stdout + run.stderr
    if run.returncode != 0:
        raise NativeBuildError(f"{source.name}: {_first_error(output)}", output)
    return output


def compile_check(ext: Extension) -> str:
    """Compile every source of ``ext`` without linking or a GPU: ``.cu`` with nvcc for sm_90a
    (``-Xptxas -v``), ``.cpp`` with the host compiler against torch's headers (syntax only).
    Returns ptxas's report (registers, spills, shared memory per kernel)."""
    reason = missing_nvcc()
    if reason is not None:
        raise NativeBuildError(f"cannot compile {ext.name}: {reason}")
    from torch.utils import cpp_extension

    nvcc = str(cuda_home() / "bin" / "nvcc")
    includes = [f"-I{p}" for p in _cuda_includes(cuda_home())]
    report = []
    with tempfile.TemporaryDirectory() as tmp:
        for source in ext.files(".cu"):
            command = [nvcc, NVCC_STD, *NVCC_FLAGS, "-Xptxas", "-v", *includes, "-c", str(source), "-o",
                       f"{tmp}/{source.stem}.o"]
            report.append(f"== {source.relative_to(RUNTIME.parent)} ==\n" + _run(command, source))
    cxx = shutil.which("c++") or shutil.which("g++")
    torch_includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), RUNTIME / SHARED_INCLUDE]]
    for source in ext.files(".cpp"):
        if cxx is None:
            report.append(f"== {source.name}: skipped, no host C++ compiler ==")
            continue
        _run([cxx, "-std=c++20", "-fsyntax-only", "-w", *torch_includes, str(source)], source)
    return "\n".join(report)
