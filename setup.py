"""Builds pyinfinity._C by driving CMake (ninja); all compile logic lives in CMakeLists.txt.

Environment: PYINFINITY_WITH_CUDA=AUTO|ON|OFF, PYINFINITY_CUDA_ARCHITECTURES (e.g. "90"),
PYINFINITY_WERROR=1, PYINFINITY_BUILD_TYPE (default Release), PYINFINITY_SANITIZE,
CMAKE_BUILD_PARALLEL_LEVEL.
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('PYINFINITY_BUILD_TYPE', 'Release')}",
            f"-DPYINFINITY_WITH_CUDA={os.environ.get('PYINFINITY_WITH_CUDA', 'AUTO')}",
            f"-DPYINFINITY_WERROR={'ON' if os.environ.get('PYINFINITY_WERROR') == '1' else 'OFF'}",
            f"-DPYINFINITY_SANITIZE={os.environ.get('PYINFINITY_SANITIZE', '')}",
        ]
        if os.environ.get("PYINFINITY_CUDA_ARCHITECTURES"):
            args.append(f"-DPYINFINITY_CUDA_ARCHITECTURES={os.environ['PYINFINITY_CUDA_ARCHITECTURES']}")
        try:
            import pybind11

            args.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
        except ImportError:
            pass
        gen = ["-G", "Ninja"] if self._have_ninja() else []
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *gen, *args], check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs], check=True)

    @staticmethod
    def _have_ninja() -> bool:
        try:
            subprocess.run(["ninja", "--version"], check=True, capture_output=True)
            return True
        except (OSError, subprocess.CalledProcessError):
            return False


setup(
    packages=find_packages(include=["pyinfinity", "pyinfinity.*"]),
    ext_modules=[Extension("pyinfinity._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
