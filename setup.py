"""The optional native kernels (models/kernels.c); everything else is in pyproject.toml.

The extension is optional: where it cannot build, the install still succeeds and the models
run on their torch operations (models/native.py)."""

from setuptools import Extension, setup

KERNELS = Extension(
    "models._kernels",
    ["models/kernels.c", "models/quant.c"],
    depends=["models/quant.h"],
    # OpenMP: at run time the libgomp that torch loaded (its soname), so torch's threads.
    # No -ffast-math: sums keep their order. Built where it runs, so -march=native.
    extra_compile_args=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
    extra_link_args=["-fopenmp"],
    optional=True,
)

setup(ext_modules=[KERNELS])
