import re
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

VERSION = re.search(r'__version__ = "(.+)"', (Path(__file__).parent / "trio_gpuworker/_version.py").read_text())

extensions = [
    Extension(f"cython_ring.{name}", [f"cython_ring/{name}.pyx"], include_dirs=["cython_ring"],
              extra_compile_args=["-O3", "-std=c11"])
    for name in ("_mo01", "_region", "_ring", "_batch", "_stream", "_egress")
]

setup(
    name="trio-gpuworker",
    version=VERSION.group(1),
    python_requires=">=3.11",
    packages=find_packages(include=["trio_gpuworker", "trio_gpuworker.*", "cython_ring"]),
    package_data={"cython_ring": ["*.pxd", "*.h", "*.pyx"], "trio_gpuworker.models": ["kernels/*.c", "kernels/*.h"]},
    ext_modules=cythonize(extensions, compiler_directives={"language_level": 3, "boundscheck": False,
                                                           "wraparound": False}),
    scripts=["bin/gpuworkerd", "bin/gpuworkerctl"],
    zip_safe=False,
)
