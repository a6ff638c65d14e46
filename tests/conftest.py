"""Test setup: the meter's allocator and threading must be set before TF starts."""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)


@pytest.fixture(autouse=True)
def _seeded():
    np.random.seed(0)
    tf.random.set_seed(0)
    yield


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "real_models: Keras applications and keras-hub models against the plain "
        "tape and plain fit (run alone with -m real_models)")
    config.addinivalue_line(
        "markers", "slow: left out of `make test` to keep CI under 15 minutes; "
        "`make test-all` runs them")
