"""Build the ggml operator for this machine (a step of ``scripts/setup.sh``).

``python -m worker.quant.ggml_build`` fetches llama-cpp-python's pinned source package from the
package index (``pip download --no-binary``: it vendors llama.cpp), builds only ggml's ``ggml-base``
and ``ggml-cpu`` static libraries (cmake, ``GGML_NATIVE=ON`` for this CPU, ``GGML_OPENMP=OFF``: the
operator runs in torch's thread pool, position-independent), then the operator
(``worker/quant/csrc/ggml_linear.cpp``) with ``torch.utils.cpp_extension`` linked against them,
compiled with OpenMP (:data:`worker.quant.ggml_kernel.CFLAGS`) so its ``at::parallel_for`` loops run
on torch's threads. All of
it lives under :func:`worker.quant.ggml_kernel.cache_root`, the library at
:func:`worker.quant.ggml_kernel.library_path` (keyed by ggml's version, torch's, the CPU's flags, the
source and its compiler flags), so a second run finds it and only checks. Prints what it did and how long it took; exits
1 when it cannot build (no compiler, no cmake, no network to the index): the worker then serves with
torch's kernels.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from worker.quant import ggml_kernel

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",
    "-DGGML_NATIVE=ON",
    "-DGGML_OPENMP=OFF",
    "-DGGML_BACKEND_DL=OFF",
    "-DGGML_BUILD_TESTS=OFF",
    "-DGGML_BUILD_EXAMPLES=OFF",
]


def ggml_source(root: Path) -> Path:
    """llama.cpp's ``ggml`` folder from the pinned source package, downloaded and extracted once."""
    ver = ggml_kernel.LLAMA_CPP_PYTHON
    tree = root / f"llama-cpp-python-{ver}" / "ggml"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    archive = root / f"llama_cpp_python-{ver}.tar.gz"
    if not archive.is_file():
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, "-d", str(root), f"llama-cpp-python=={ver}"], check=True)
    prefix = f"llama_cpp_python-{ver}/vendor/llama.cpp/ggml/"
    staging = tree.with_name("ggml.partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(staging, members=members, filter="data")
    # ggml's standalone CMakeLists writes a pkg-config file from ggml.pc.in, which the package leaves out
    (staging / "ggml.pc.in").touch()
    staging.rename(tree)
    archive.unlink()
    return tree


def build_ggml(src: Path, out: Path) -> Path:
    """Configure and build ``ggml-base`` and ``ggml-cpu`` into ``out`` (once: a built one is kept);
    returns the libraries' folder."""
    libs = out / "src"
    if (libs / "libggml-cpu.a").is_file() and (libs / "libggml-base.a").is_file():
        return libs
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", str(src), "-B", str(out), *gen, *CMAKE_FLAGS])
    _run(["cmake", "--build", str(out), "--target", "ggml-base", "ggml-cpu", "-j"])
    return libs


def _run(cmd: list[str]) -> None:
    """Run ``cmd`` quietly; on failure print the end of its output and raise ``CalledProcessError``."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        print((done.stdout + done.stderr)[-3000:], file=sys.stderr)
        done.check_returncode()


def build_operator(src: Path, libs: Path, dest: Path) -> Path:
    """The operator's shared library, linked against the static ggml libraries in ``libs``."""
    from torch.utils import cpp_extension

    work = dest.parent / "op-build"
    work.mkdir(parents=True, exist_ok=True)
    built = cpp_extension.load(
        name=ggml_kernel.NAME,
        sources=[str(ggml_kernel.SOURCE)],
        # ggml-cpu's own headers and llamafile/sgemm.cpp, which ggml_tinyblas.h compiles in
        extra_include_paths=[str(src / "include"), str(src / "src"), str(src / "src" / "ggml-cpu")],
        extra_cflags=list(ggml_kernel.CFLAGS),
        # -fopenmp links libgomp.so.1, the OpenMP runtime torch has already loaded: one thread pool
        extra_ldflags=[str(libs / "libggml-cpu.a"), str(libs / "libggml-base.a"), "-fopenmp", "-lpthread"],
        build_directory=str(work),
        is_python_module=False,
        verbose=False,
    )
    shutil.copy(built, dest)
    return dest


def main() -> int:
    """Build unless built; print the outcome and its time. 0 when the operator is there and loads."""
    start = time.monotonic()
    dest = ggml_kernel.library_path()
    if dest.is_file():
        print(f"ggml kernels already built: {dest}")
        return 0
    root = ggml_kernel.cache_root()
    root.mkdir(parents=True, exist_ok=True)
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        print(f"ggml kernels not built ({', '.join(missing)} not found): the worker will serve with torch's kernels")
        return 1
    try:
        src = ggml_source(root)
        libs = build_ggml(src, ggml_kernel.ggml_dir() / "build")
        dest.parent.mkdir(parents=True, exist_ok=True)
        build_operator(src, libs, dest)
    except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
        print(f"ggml kernels not built ({exc}): the worker will serve with torch's kernels")
        return 1
    # cpp_extension.load has loaded the library into this process: a second load would register the ops
    # twice, so a fresh interpreter checks that it loads as the worker loads it
    check = "from worker.quant import ggml_kernel; raise SystemExit(0 if ggml_kernel.load() else 1)"
    if subprocess.run([sys.executable, "-c", check], check=False).returncode:
        print(f"ggml kernels built but not loadable: {dest}")
        dest.unlink()
        return 1
    print(f"ggml kernels built in {time.monotonic() - start:.0f}s: {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
