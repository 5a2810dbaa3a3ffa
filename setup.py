"""Builds kungfu's native libraries with CMake; nothing else happens here."""
import os
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        extdir = os.path.abspath(os.path.dirname(self.get_ext_fullpath(ext.name)))
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        os.makedirs(build_dir, exist_ok=True)
        cfg = os.environ.get("KUNGFU_BUILD_TYPE", "Release")
        import pybind11

        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        ]
        here = os.path.dirname(os.path.abspath(__file__))
        subprocess.check_call(["cmake", here] + args, cwd=build_dir)
        jobs = str(os.cpu_count() or 2)
        subprocess.check_call(["cmake", "--build", ".", "-j", jobs], cwd=build_dir)


setup(
    ext_modules=[CMakeExtension("kungfu._kungfu")],
    cmdclass={"build_ext": CMakeBuild},
)
