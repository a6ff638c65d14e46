"""The real models of the conformance suite (and of the model-zoo benchmark).

Keras applications (``weights=None``), keras-hub's GPT2 (causal LM) and BERT
(classifier) from 2-layer configs, and Keras LSTMs (stateful too), built
from a seed with inputs, labels and a loss. Nothing is downloaded.
"""

import contextlib

import keras
import numpy as np

APPLICATIONS = ("ResNet50", "DenseNet121", "MobileNetV2", "EfficientNetB0", "ConvNeXtTiny")
MODELS = APPLICATIONS + ("GPT2", "BERT", "LSTM", "LSTMStateful")
STATEFUL_BATCH = 2   # a stateful RNN is built for one batch size
# Applications the conformance suite also builds (not in the zoo), with the
# options that make a step deterministic.
MORE_APPLICATIONS = {"MobileNetV3Small": {"dropout_rate": 0.0}}


@contextlib.contextmanager
def dtype_scope(dtype):
    """Layers built here compute in ``dtype``; the global policy is restored."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def build(name, batch, dtype="float64", size=32):
    """``(model, inputs, labels, loss)`` for ``batch`` samples, seeded.

    ``size`` is the image side of the applications; ``dtype`` the compute
    and variable dtype of every layer.
    """
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    with dtype_scope(dtype):
        if name in APPLICATIONS or name in MORE_APPLICATIONS:
            model = getattr(keras.applications, name)(
                weights=None, input_shape=(size, size, 3), classes=10,
                **MORE_APPLICATIONS.get(name, {}))
            x = rng.rand(batch, size, size, 3).astype(dtype)
            y = rng.randint(0, 10, batch)
            return model, x, y, keras.losses.SparseCategoricalCrossentropy()
        if name.startswith("LSTM"):
            stateful = name == "LSTMStateful"
            model = keras.Sequential([
                keras.Input((12, 8), batch_size=STATEFUL_BATCH if stateful else None),
                keras.layers.LSTM(32, return_sequences=True, stateful=stateful),
                keras.layers.LSTM(32, stateful=stateful),
                keras.layers.Dense(4)])
            return (model, rng.rand(batch, 12, 8).astype(dtype), rng.randint(0, 4, batch),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        import keras_hub  # pylint: disable=import-outside-toplevel
        config = dict(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=32,
                      intermediate_dim=64, max_sequence_length=16, dropout=0.0)
        ids = rng.randint(0, 64, (batch, 16)).astype("int32")
        tokens = keras.Input((16,), dtype="int32")
        mask = keras.Input((16,), dtype="int32")
        if name == "GPT2":
            backbone = keras_hub.models.GPT2Backbone(**config)
            hidden = backbone({"token_ids": tokens, "padding_mask": mask})
            model = keras.Model([tokens, mask], backbone.token_embedding(hidden, reverse=True))
            labels = np.roll(ids, -1, axis=1)   # next-token targets
            return (model, [ids, np.ones_like(ids)], labels,
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        backbone = keras_hub.models.BertBackbone(**config)
        segments = keras.Input((16,), dtype="int32")
        out = backbone({"token_ids": tokens, "segment_ids": segments, "padding_mask": mask})
        model = keras.Model([tokens, segments, mask], keras.layers.Dense(3)(out["pooled_output"]))
        return (model, [ids, np.zeros_like(ids), np.ones_like(ids)], rng.randint(0, 3, batch),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
