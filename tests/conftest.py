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
    plain against plain. Tests marked ``fallback`` run with the default
    users get; real-model tests too, less the margin a plan must save
    without a budget or cap (``MIN_SAVING``): at their tiny sizes (32x32
    images, batch 2) the applications' plans are estimated 2-10% below
    plain's, so with it they would check plain against plain."""
    if request.node.get_closest_marker("fallback"):
        return
    if request.node.get_closest_marker("real_models"):
        from memsave import api   # pylint: disable=import-outside-toplevel
        monkeypatch.setattr(api, "MIN_SAVING", 0.0)
        return
    from memsave.planning.plan import Plan   # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(Plan, "worse_than_plain", lambda self, margin=0.0: False)


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

# Left out of `make test` to keep CI within 15 minutes (test, substring of the
# case id or "" for all its cases): the longest tests on 2 cores whose class
# `make test` still covers with a shorter sibling, named after each group.
# Seconds from `pytest --durations=0` in `make test-all` (oneDNN on). The
# random graphs of tests/test_properties.py run in both, a third as many in
# `make test` (hypothesis profile "quick").
SLOW_CASES = (
    # Through the tape, CI runs one application (MobileNetV2: depthwise
    # convolutions, batch norm), the transformers and LSTMs; ResNet50 also
    # in float32, with oneDNN on and off.
    ("test_tape_in_tf_function", "DenseNet121"),                       # 141 s
    ("test_tape_in_tf_function", "EfficientNetB0"),                    # 87 s
    ("test_tape_in_tf_function", "ResNet50"),                          # 63 s
    ("test_tape_in_tf_function", "ConvNeXtTiny"),                      # 59 s
    ("test_tape_in_float32_where_onednn_fuses", "DenseNet121"),        # 35 s (x2)
    # test_fit_in_budget_example_trains_where_plain_runs_out_of_memory
    # (test_benchmarks.py) runs one model under a hard allocator limit.
    ("test_two_models_train_under_a_hard_limit_where_plain_runs_out_of_memory", ""),  # 190 s
    # Measured peaks: the 100-layer chain in a Session, the custom-gradient
    # chain and test_optimal's ResNet, U-Net and budget cases stay.
    ("test_unrolled_lstm_weight_gradient_pieces", ""),                 # 52 s
    ("test_2000_layer_chain_memory", ""),                              # 35 s
    ("test_chain400_optimal", ""),                                     # 26 s
    ("test_dense_block_optimal", ""),                                  # 19 s
    # The U-Net without batch norm, and test_shapes' U-Net without hints, stay.
    ("test_unet_optimal_beats_plain_and_memory", "conv-bn-relu"),      # 26 s
    ("test_memory_64_dense_layers", ""),                               # 14 s
    ("test_chain100_memory_function", ""),                             # 13 s
    ("test_resnet100_memory_session", ""),                             # 10 s
    ("test_peak_memory_constant_in_depth", ""),                        # 26 s
    # test_rewrite_speed_benchmark_tiny runs a benchmark end to end.
    ("test_models_benchmark_tiny", ""),                                # 39 s
    ("test_depth_benchmark_tiny", ""),                                 # 26 s
    # The multi-worker custom loop and the mirrored fit stay.
    ("test_mirrored_custom_loop_rewrites_per_replica_and_keeps_swaps_on_replica_devices",
     ""),                                                              # 14 s
    # Keras known classes: 'optimal' (the default) stays; 'memory' and
    # 'speed' reach the same mechanisms.
    ("test_keras_rnn_with_dropout_in_its_cell", "memory"),             # 15 s
    ("test_keras_rnn_with_dropout_in_its_cell", "speed"),              # 16 s
    ("test_keras_conv_bn_fit_float32", "memory"),                      # 13 s
    ("test_keras_conv_bn_fit_float32", "speed"),                       # 12 s
    ("test_keras_conv_bn_mixed_bfloat16_with_offload", "memory"),      # 6 s
    ("test_keras_conv_bn_mixed_bfloat16_with_offload", "speed"),       # 7 s
)


def pytest_collection_modifyitems(config, items):
    del config
    for item in items:
        name = getattr(item, "originalname", item.name)
        for cases, marker in ((HEAVY_CASES, pytest.mark.heavy), (SLOW_CASES, pytest.mark.slow)):
            if any(name == fn and case in item.name for fn, case in cases):
                item.add_marker(marker)
