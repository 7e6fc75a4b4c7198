"""Which of ``bench/``'s own modules the wheel ships; the rest of the build is pyproject.toml.

setuptools puts every module of an included package into the wheel and excludes only whole
packages, which ``[tool.setuptools.packages.find]`` does for ``bench``'s subpackages other
than ``bench.loadgen``. The ``bench`` package's own modules are mostly benchmarks run from a
checkout (``python -m bench.engine``, ``python bench/serve_compare.py``); of them the wheel
keeps what ``prefixserve bench`` imports (``bench.cli:add_parser``, hooked in by
``cluster/cli.py``, and ``bench.common``, which ``bench.loadgen.metrics`` uses). An editable
install maps the whole folder and still sees every module.
"""

from setuptools import setup
from setuptools.command.build_py import build_py

WHEEL_BENCH_MODULES = {"__init__", "cli", "common"}


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package != "bench":
            return modules
        return [m for m in modules if m[1] in WHEEL_BENCH_MODULES]


setup(cmdclass={"build_py": BuildPy})
