"""Shared pytest set-up: quiet TensorFlow before anything imports it."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def pytest_configure(config):
    """Markers: ``ci`` -- a slice of a longer script's matrix (scripts/equivalence.py), sized
    to run in every CI run."""
    config.addinivalue_line("markers", "ci: a slice of a longer script's matrix, sized for CI")
