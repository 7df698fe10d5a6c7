"""What this machine is: MLX device, BLAS, Core ML availability, cache folder.

Every "am I on macOS?" question in the project is answered here and nowhere else.

Importing this module before MLX makes MLX use OpenBLAS on Linux when it is installed: the
`mlx[cpu]` wheel links a bundled reference BLAS that is ~30x slower for prefill, and loading
OpenBLAS into the global symbol scope first makes MLX's BLAS calls resolve to it.
`mirror_mlx/__init__.py` imports this module first for that reason.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.machinery
import importlib.util
import os
import platform as _platform
import sys
from dataclasses import dataclass
from pathlib import Path

_OPENBLAS_PATHS = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def _load_openblas() -> tuple[str | None, str]:
    """Load OpenBLAS globally before MLX; returns (path or None, why not)."""
    if sys.platform != "linux":
        return None, ""
    if os.environ.get("MIRROR_MLX_BLAS", "").lower() == "reference":
        return None, "MIRROR_MLX_BLAS=reference"
    if "mlx.core" in sys.modules:
        return None, "mlx was imported before mirror_mlx; import mirror_mlx first"
    arch = _platform.machine()
    candidates = [os.environ.get("MIRROR_MLX_OPENBLAS", "")]
    candidates += [p.format(arch=arch) for p in _OPENBLAS_PATHS]
    candidates.append(ctypes.util.find_library("openblas") or "")
    for path in filter(None, candidates):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path, ""
        except OSError:
            continue
    return None, "OpenBLAS not installed (Debian: apt-get install libopenblas0-pthread)"


OPENBLAS_PATH, _NO_OPENBLAS_REASON = _load_openblas()


def set_blas_threads(n: int) -> bool:
    """Threads per OpenBLAS call (process-wide). With a draft computing on the other core at
    the same time, one thread each avoids two callers queueing on one thread pool. Returns
    False where the BLAS is not OpenBLAS."""
    if not OPENBLAS_PATH:
        return False
    ctypes.CDLL(OPENBLAS_PATH).openblas_set_num_threads(int(n))
    return True


if os.environ.get("MIRROR_MLX_BLAS_THREADS", "").isdigit():
    set_blas_threads(int(os.environ["MIRROR_MLX_BLAS_THREADS"]))


def blas_description() -> str:
    if sys.platform == "darwin":
        return "Accelerate"
    if OPENBLAS_PATH:
        return f"OpenBLAS ({OPENBLAS_PATH})"
    return f"reference BLAS bundled with mlx ({_NO_OPENBLAS_REASON})"


def is_macos() -> bool:
    return sys.platform == "darwin"


def macos_version() -> tuple[int, ...]:
    if not is_macos():
        return ()
    return tuple(int(p) for p in _platform.mac_ver()[0].split(".") if p.isdigit())


# Where a draft may be asked to run (--draft-device): auto is draft/select.py's choice.
DRAFT_DEVICES = ("auto", "cpu", "gpu")


def mlx_device() -> str:
    """The device MLX computes on by default: 'gpu' (Metal or CUDA) or 'cpu'."""
    import mlx.core as mx

    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def mlx_backend() -> str:
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def wired_limit_bytes() -> tuple[int | None, str]:
    """How much MLX memory to wire (keep resident, never paged out) while an engine is open:
    Metal's recommended working set, as mlx-lm does; or None and why not. MLX wires memory
    with Metal residency sets, which macOS 15 brought; elsewhere there is nothing to wire."""
    import mlx.core as mx

    if not is_macos():
        return None, f"memory is wired only with Metal on macOS (this is {_platform.system()})"
    if macos_version() < (15,):
        return None, "MLX wires memory on macOS 15 or later"
    if mlx_backend() != "metal":
        return None, "MLX is not computing with Metal"
    size = mx.device_info().get("max_recommended_working_set_size")
    if not size:
        return None, "Metal reports no recommended working set"
    return int(size), ""


def coreml_status() -> tuple[bool, str]:
    """Whether Core ML models can be executed here, and why not."""
    if not is_macos():
        return False, f"Core ML runs only on macOS (this is {_platform.system()})"
    if macos_version() < (15,):
        return False, "Core ML stateful models need macOS 15 or later"
    problem = coremltools_problem()
    return (False, problem) if problem else (True, "available")


def coremltools_problem() -> str | None:
    """Why coremltools cannot run Core ML models in this Python, or None. Its prediction API
    lives in a native module (libcoremlpython) that only its macOS wheels carry, and only for
    the Python versions they were built for: without it coremltools still imports, converts
    and saves, and `CompiledMLModel` fails later with a bare Exception. Checked without
    importing coremltools (slow)."""
    spec = importlib.util.find_spec("coremltools")
    if spec is None:
        return "coremltools is not installed (pip install 'mirror-mlx[export]')"
    folders = [Path(f) for f in spec.submodule_search_locations or ()]
    if not any((f / f"libcoremlpython{suffix}").is_file()
               for f in folders for suffix in importlib.machinery.EXTENSION_SUFFIXES):
        return (f"coremltools has no Core ML bindings for Python {_platform.python_version()} "
                "(its native module libcoremlpython is missing): install mirror-mlx in a "
                "Python version that coremltools publishes macOS wheels for")
    return None


def coreml_can_run() -> bool:
    return coreml_status()[0]


def cache_dir() -> Path:
    """Where downloaded models and compiled packages live (MIRROR_MLX_CACHE overrides)."""
    if env := os.environ.get("MIRROR_MLX_CACHE"):
        return Path(env).expanduser()
    if is_macos():
        return Path.home() / "Library" / "Caches" / "mirror-mlx"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mirror-mlx"


@dataclass(frozen=True)
class MachineInfo:
    platform: str
    machine: str
    python: str
    mlx_version: str
    mlx_backend: str
    mlx_device: str
    blas: str
    coreml: str
    cache_dir: str
    cpu_count: int

    def lines(self) -> list[str]:
        return [f"{k.replace('_', ' ')}: {v}" for k, v in self.__dict__.items()]


def machine_info() -> MachineInfo:
    import mlx.core as mx

    ok, why = coreml_status()
    system = _platform.platform()
    if is_macos():
        system = f"macOS {_platform.mac_ver()[0]}"
    return MachineInfo(
        platform=system,
        machine=_platform.machine(),
        python=_platform.python_version(),
        mlx_version=mx.__version__,
        mlx_backend=mlx_backend(),
        mlx_device=mlx_device(),
        blas=blas_description(),
        coreml="available" if ok else f"unavailable: {why}",
        cache_dir=str(cache_dir()),
        cpu_count=os.cpu_count() or 1,
    )
