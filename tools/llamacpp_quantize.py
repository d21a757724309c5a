"""Build llama.cpp's own `llama-quantize` (and `llama-imatrix`) from the llama.cpp source vendored in
the llama-cpp-python sdist, once, as external reference tools for the K-quant / imatrix tests.

    python3 tools/llamacpp_quantize.py [--imatrix]      # prints the binary's path (builds if needed)

The build goes to ~/.cache/specconv/llamacpp-tools-<version>/ (cmake, only the named targets,
GGML_NATIVE=OFF so the reference code is compiled for baseline x86-64 without FMA contraction,
no BLAS, no OpenMP, no curl/OpenSSL); a finished build is reused. `binary()` returns None with the
reason when cmake or a C++ compiler is missing, so tests skip with that reason. Never copied into
this project: the tools are only run on files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VERSION = "0.3.36"
CACHE = Path(os.environ.get("SPECCONV_CACHE", Path.home() / ".cache" / "specconv"))
SOURCE = CACHE / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
BUILD = CACHE / f"llamacpp-tools-{VERSION}"
TARGETS = {"quantize": "llama-quantize", "imatrix": "llama-imatrix"}
FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_BLAS=OFF", "-DGGML_OPENMP=OFF",
         "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
         "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON", "-DGGML_CCACHE=OFF"]


def _program(name: str) -> str | None:
    """`name` on PATH, else the binary of pip's package of that name (cmake, ninja), else None."""
    found = shutil.which(name)
    if found:
        return found
    try:
        module = __import__(name)
    except ImportError:
        return None
    return str(Path(getattr(module, "CMAKE_BIN_DIR", None) or module.BIN_DIR) / name)


def missing() -> str | None:
    """Why the tools cannot be built here, or None."""
    if not SOURCE.is_dir():
        return f"llama.cpp source not found at {SOURCE} (the llama-cpp-python {VERSION} sdist, unpacked)"
    if _program("cmake") is None:
        return "cmake not found (install it, or pip's cmake package)"
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        return "no C++ compiler (c++/g++/clang++) on PATH"
    return None


def binary(tool: str = "quantize", jobs: int = 0) -> tuple[Path | None, str]:
    """(path of the built tool, "") or (None, why not). Builds on first use; a lock file keeps two
    processes from building at once (the second waits)."""
    exe = BUILD / "bin" / TARGETS[tool]
    if exe.is_file():
        return exe, ""
    why = missing()
    if why:
        return None, why
    BUILD.mkdir(parents=True, exist_ok=True)
    lock = BUILD / ".lock"
    import fcntl

    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        if exe.is_file():
            return exe, ""
        cmake = _program("cmake")
        log = BUILD / "build.log"
        with open(log, "a") as out:
            start = time.time()
            ninja = _program("ninja")
            generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else ["-G", "Unix Makefiles"]
            steps = [[cmake, "-S", str(SOURCE), "-B", str(BUILD), *generator, *FLAGS],
                     [cmake, "--build", str(BUILD), "--target", *TARGETS.values(), "-j", str(jobs or os.cpu_count() or 2)]]
            for cmd in steps:
                out.write("$ " + " ".join(cmd) + "\n")
                out.flush()
                r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
                if r.returncode:
                    return None, f"building {TARGETS[tool]} failed (exit {r.returncode}); see {log}"
            out.write(f"built in {time.time() - start:.0f} s wall\n")
    return (exe, "") if exe.is_file() else (None, f"{exe} missing after the build; see {log}")


def main() -> None:
    tool = "imatrix" if "--imatrix" in sys.argv[1:] else "quantize"
    path, why = binary(tool)
    if path is None:
        sys.exit(why)
    print(path)


if __name__ == "__main__":
    main()
