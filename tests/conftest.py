"""Test setup: the meter's allocator and threading must be set before TF starts."""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# jax (the xla extra, for deviceless GPU compiles) must not look for a GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)


@pytest.fixture(autouse=True)
def _seeded():
    np.random.seed(0)
    tf.random.set_seed(0)
    yield


@pytest.fixture(autouse=True)
def _rewrite_even_where_it_does_not_pay(request, monkeypatch):
    """Most tests check the rewrite itself, on graphs too small for it to pay:
    the estimate-based fallback to plain gradients would make them check
    plain against plain. Real-model tests, and tests marked ``fallback``,
    run with the default users get."""
    if request.node.get_closest_marker("real_models") or \
            request.node.get_closest_marker("fallback"):
        return
    from memsave.planning.plan import Plan   # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(Plan, "worse_than_plain", lambda self: False)


@pytest.fixture
def tanh_chain():
    """``tests.builders.tanh_chain``: a seeded tanh(matmul) chain in a tf.Graph."""
    from tests import builders   # pylint: disable=import-outside-toplevel
    return builders.tanh_chain


@pytest.fixture
def plan_chain():
    """``tests.builders.plan_chain``: the same chain as a planning graph."""
    from tests import builders   # pylint: disable=import-outside-toplevel
    return builders.plan_chain


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "real_models: Keras applications and keras-hub models against the plain "
        "tape and plain fit (run alone with -m real_models)")
    config.addinivalue_line(
        "markers", "fallback: runs with memsave's default fallback to plain gradients "
        "(other tests turn it off to check the rewrite itself)")
    config.addinivalue_line(
        "markers", "slow: left out of `make test` to keep CI under 15 minutes; "
        "`make test-all` runs them")
    config.addinivalue_line(
        "markers", "both_onednn: float32 conv and real-model cases that `make test` runs "
        "twice, with oneDNN's fusions on (TF_ENABLE_ONEDNN_OPTS=1) and off (=0)")
    config.addinivalue_line(
        "markers", "heavy: in `make test` (CI) but left out of `make test-fast`, the "
        "tier for development (measured peaks, deep graphs, benchmarks, subprocesses)")


# Parametrized cases that are heavy while their siblings are not:
# (test function, substring of the case id).
HEAVY_CASES = (
    ("test_gradients_equal_plain", "chain100"),
    ("test_gradients_equal_plain_tape", "-32]"),
)


def pytest_collection_modifyitems(config, items):
    del config
    for item in items:
        name = getattr(item, "originalname", item.name)
        if any(name == fn and case in item.name for fn, case in HEAVY_CASES):
            item.add_marker(pytest.mark.heavy)
