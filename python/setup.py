"""Builds libpsclient.so (the CMake target ps_client_shared of the repository
this directory lies in) and ships it inside the package, so that
`pip install ./python` is the one command. The library is built in
python/build-cmake, or in $PS_BUILD_DIR when it is set (an existing build
directory of the project: only that target is built there)."""
import os
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def build_library():
    build = os.environ.get("PS_BUILD_DIR") or os.path.join(HERE, "build-cmake")
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
        if not os.path.exists(os.path.join(ROOT, "CMakeLists.txt")):
            raise RuntimeError(f"{ROOT} holds no CMakeLists.txt: build from the repository's "
                               "python/ directory (pip install ./python)")
        subprocess.check_call(["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                               "-DWITH_CUDA=OFF"], stdout=subprocess.DEVNULL)
    jobs = str(os.cpu_count() or 2)
    subprocess.check_call(["cmake", "--build", build, "--target", "ps_client_shared", "-j", jobs])
    lib = os.path.join(build, "libpsclient.so")
    if not os.path.exists(lib):
        raise RuntimeError(f"the build made no {lib}")
    return lib


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "psclient")
        os.makedirs(dest, exist_ok=True)
        shutil.copy(build_library(), os.path.join(dest, "libpsclient.so"))


class BinaryDistribution(Distribution):
    """The wheel holds a shared library: tag it for this platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution)
