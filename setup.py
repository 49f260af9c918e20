"""The compiled part (issue 36): the rest of the build is in pyproject.toml. ``optional``: a
machine that cannot build it (no compiler, no Python headers) installs the package without
it, and the load process runs the Python originals (streamquake/loadgen/speedups.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("streamquake.loadgen._speedups",
                             ["streamquake/loadgen/_speedups.c"],
                             extra_compile_args=["-O2"], optional=True)])
