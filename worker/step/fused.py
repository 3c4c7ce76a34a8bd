"""Build and load the fused CPU operators of a decode step (``fused.cpp``): RMSNorm with its output
cast, RoPE with the cache write, decode attention over block tables, SiLU·up.

Built once per machine with the system's C++ compiler against the installed torch, as a Python
extension module (called through pybind11, not the dispatcher: a call costs about a microsecond),
into :func:`cache_dir` under a key of the source, torch's and Python's versions and the CPU's flags:
a restart, a second replica or an ``apply`` loads the built file. The build writes to a temporary
name and renames, so replicas building at once do not read half a file. :func:`load` returns None
(and says why in one log line) where no compiler is found or the build fails; the engine then runs
every step eagerly.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from worker.contract import env

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused.cpp")
HEADERS = [Path(__file__).with_name("attention.h")]  # included by SOURCE: part of the build key
NAME = "llamadeploy_step"
_loaded: dict[str, object] = {}
# -ffp-contract=off: no fused multiply-adds, so RoPE's products and sum round as torch's operations do
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def cache_dir() -> Path:
    """Where built operators live: ``$LLAMADEPLOY_CACHE`` (else ``~/.cache/llamadeploy``) ``/step``."""
    return env.cache_root() / "step"


def cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``), part of the build key: ``-march=native`` code may
    not run on another CPU that shares this home directory."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def build_key() -> str:
    """Hex digest naming one build: source, torch, Python, CPU flags, compiler flags."""
    import torch

    h = hashlib.sha256(SOURCE.read_bytes())
    for header in HEADERS:
        h.update(header.read_bytes())
    for part in (torch.__version__, sys.version, cpu_flags(), " ".join(FLAGS)):
        h.update(part.encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    return cache_dir() / build_key() / f"{NAME}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def compile_command(out: Path) -> list[str]:
    """The compiler's command line for ``fused.cpp`` into ``out`` (torch's headers and libraries)."""
    import torch
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libs = cpp_extension.library_paths()
    return [
        cxx,
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-DTORCH_EXTENSION_NAME={NAME}",
        *[f"-I{p}" for p in includes],
        str(SOURCE),
        *[f"-L{p}" for p in libs],
        *[f"-Wl,-rpath,{p}" for p in libs],
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
        "-o",
        str(out),
    ]


def build(path: Path) -> None:
    """Compile into ``path`` (a temporary name first, then renamed). Raises ``OSError`` /
    ``subprocess.CalledProcessError``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    start = time.monotonic()
    log.info("compiling the fused decode-step operators (%s) into %s", SOURCE.name, path.parent)
    subprocess.run(compile_command(tmp), check=True, capture_output=True, text=True)
    os.replace(tmp, path)
    log.info("compiled the fused decode-step operators in %.1fs", time.monotonic() - start)


@contextlib.contextmanager
def _build_lock(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load():
    """The operators' module, built first where it is not (see the module's docstring); None when
    it cannot be built or loaded (one warning line says why)."""
    path = library_path()
    key = str(path)
    if key in _loaded:
        return _loaded[key]
    module = None
    try:
        if not path.is_file():
            with _build_lock(path.parent):  # replicas starting together: one compiles, the others wait
                if not path.is_file():
                    build(path)
        spec = importlib.util.spec_from_file_location(NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or "").strip().splitlines()[-1:] or ["?"]
        log.warning("fused decode step off: compiling %s failed (%s); every step runs eagerly", SOURCE.name, tail[0])
        module = None
    except (OSError, ImportError) as exc:
        log.warning("fused decode step off: %s; every step runs eagerly", exc)
        module = None
    _loaded[key] = module
    return module


def main() -> int:
    """``python -m worker.step.fused``: build (unless built) and load; 0 when the operators load."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load()
    log.info("fused decode-step operators: %s", library_path() if module is not None else "not available")
    return 0 if module is not None else 1


if __name__ == "__main__":
    sys.exit(main())
