"""Install TAPAS: the `tapas` package, its model zoo (`tapas.models`, from models/) and the
`tapas` command. GPU users: install `tensorflow[and-cuda]==2.21.0` in place of
`tensorflow-cpu` (see README)."""

import os

from setuptools import find_packages, setup

CPU_ONLY = os.environ.get("TAPAS_TF_PACKAGE", "tensorflow-cpu==2.21.0")

setup(
    name="tapas",
    version="0.1.0",
    description="Tensor Auto-Parallelisation: automatic tensor-parallel strategies for Keras/TensorFlow",
    python_requires=">=3.10",
    packages=find_packages(include=["tapas", "tapas.*"]) + ["tapas.models"],
    package_dir={"tapas": "tapas", "tapas.models": "models"},
    install_requires=[
        CPU_ONLY,
        "numpy",
        "networkx>=3.2",
        "absl-py>=2.0",
        "matplotlib>=3.7",
    ],
    extras_require={"test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6"]},
    entry_points={"console_scripts": ["tapas=tapas.cli:run"]},
)
