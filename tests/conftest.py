"""Shared pytest set-up: quiet TensorFlow before anything imports it."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
