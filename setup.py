"""Builds kungfu's native libraries with CMake; nothing else happens here."""
import os
import shutil
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
        here = os.path.dirname(os.path.abspath(__file__))
        # Editable and in-place builds put every native file (the module, the runtime library it
        # loads, the TensorFlow op library) into the source package, where `import kungfu` finds
        # them together; a wheel build puts them into the build tree that becomes the wheel.
        in_source = getattr(self, "editable_mode", False) or self.inplace
        outdir = os.path.join(here, "kungfu") if in_source else extdir
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        os.makedirs(build_dir, exist_ok=True)
        cfg = os.environ.get("KUNGFU_BUILD_TYPE", "Release")
        # KUNGFU_BUILD_TENSORFLOW=0: the numpy-only core, on purpose. Otherwise CMake builds the
        # TensorFlow op library or stops with an error that says how to install.
        with_tf = os.environ.get("KUNGFU_BUILD_TENSORFLOW", "1").strip().lower()
        if with_tf not in ("0", "1", "false", "true", "off", "on", "no", "yes"):
            raise SystemExit(f"KUNGFU_BUILD_TENSORFLOW={with_tf!r}: give 0 or 1")
        with_tf = with_tf in ("1", "true", "on", "yes")
        import pybind11

        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={outdir}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DKUNGFU_BUILD_TENSORFLOW={'ON' if with_tf else 'OFF'}",
        ]
        if subprocess.call(["cmake", here] + args, cwd=build_dir) != 0:
            # CMake printed why (TensorFlow not importable, say, with the command to use).
            raise SystemExit("kungfu: CMake's configure step failed; its message above says why")
        jobs = str(os.cpu_count() or 2)
        subprocess.check_call(["cmake", "--build", ".", "-j", jobs], cwd=build_dir)
        if outdir != extdir:  # setuptools expects the module where it would have built it
            os.makedirs(extdir, exist_ok=True)
            module = os.path.basename(self.get_ext_fullpath(ext.name))
            shutil.copy2(os.path.join(outdir, module), os.path.join(extdir, module))


setup(
    ext_modules=[CMakeExtension("kungfu._kungfu")],
    cmdclass={"build_ext": CMakeBuild},
)
