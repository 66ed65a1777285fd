"""Package discovery for setuptools; all other metadata is in pyproject.toml.

dualwrite's Alembic environment lives in the top-level ``migrations/`` directory and is installed
as the package ``dualwrite._migrations``. ``[tool.setuptools.packages.find]`` cannot add a package
mapped from another directory, and a fixed ``packages = [...]`` list in pyproject.toml would
silently leave new subpackages out of the wheel, hence these few lines.
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=[
        *find_namespace_packages(include=["dualwrite*"], exclude=["*.__pycache__"]),
        "dualwrite._migrations",
        "dualwrite._migrations.versions",
    ],
    package_dir={"dualwrite._migrations": "migrations"},
)
