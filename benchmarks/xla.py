"""XLA's GPU memory for plain and memsave training steps, without a GPU.

Each step is a ``tf.function(jit_compile=True)`` computing the loss and its
gradients (``tf.GradientTape`` for plain, ``memsave.GradientTape`` for
memsave). Its HLO is compiled for an NVIDIA H100 by XLA's GPU compiler on
this CPU (see :mod:`benchmarks.xla_gpu`) and the table gives the temp
buffers of the compiled step: the memory for intermediates, which is what
checkpointing lowers (weights and inputs are arguments, gradients outputs;
both are the same for every row), the whole step's memory, the matmul
FLOPs and a roofline estimate of the step's time on the H100 (see
:func:`benchmarks.xla_gpu.roofline_seconds`). Buffer assignment is
deterministic: one compile per row. Beside them, on the chain:
``tf.recompute_grad`` and JAX's ``jax.checkpoint`` over 4-layer segments
(``prevent_cse`` True and False).

Where TensorFlow sees a GPU, each step also runs once and the table gets
the allocator's peak (``tf.config.experimental.get_memory_info``).

    python -m benchmarks.xla                    # chain, ResNet50, GPT2, BERT
    python -m benchmarks.xla --models chain     # one model

Needs the ``xla`` extra. Writes ``benchmarks/results/xla.{json,md,png}``.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import cli  # noqa: E402
from benchmarks import xla_gpu  # noqa: E402  (sets JAX_PLATFORMS before jax loads)
from benchmarks.zoo import error_line  # noqa: E402

MODELS = ("chain", "ResNet50", "GPT2", "BERT")
STRATEGIES = (("optimal", {}), ("memory", {}), ("speed", {}), ("optimal", {"budget": 0.5}),
              ("optimal", {"max_recompute": 0.02}), ("optimal", {"max_recompute": 0.05}))
MIB = 2.0 ** 20

# The chain: 32 layers of tanh(h @ W), 256 units, batch 4096 (4 MiB per activation).
CHAIN = dict(layers=32, units=256, batch=4096, segment=4)


def _chain():
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    rng = np.random.RandomState(0)
    c = CHAIN
    ws = [tf.Variable(rng.randn(c["units"], c["units"]).astype("float32") / 16)
          for _ in range(c["layers"])]
    x = tf.constant(rng.randn(c["batch"], c["units"]).astype("float32"))

    def layers(h, weights):
        for w in weights:
            h = tf.tanh(h @ w)
        return h

    def loss():
        return tf.reduce_sum(layers(x, ws) ** 2)

    def recompute_grad_loss():
        h = x
        for i in range(0, c["layers"], c["segment"]):
            h = tf.recompute_grad(lambda h, i=i: layers(h, ws[i:i + c["segment"]]))(h)
        return tf.reduce_sum(h ** 2)

    return loss, ws, {"tf.recompute_grad (4 layers)": recompute_grad_loss}


def _resnet50():
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)
    x = tf.constant(rng.rand(32, 224, 224, 3).astype("float32"))
    y = tf.constant(rng.randint(0, 1000, 32))
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    return (lambda: loss_fn(y, model(x, training=True))), model.trainable_variables, {}


def _transformer(backbone_class, vocabulary_size, next_token, **inputs):
    """A keras-hub backbone at GPT-2 small's size (12 layers, 768 hidden),
    1,024 tokens, batch 8, and the cross-entropy of its tied embedding's
    logits: for the next token (``next_token``) or for each token itself
    (masked-LM's head without the masking)."""
    import keras  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    backbone = backbone_class(
        vocabulary_size=vocabulary_size, num_layers=12, num_heads=12, hidden_dim=768,
        intermediate_dim=3072, max_sequence_length=1024, dropout=0.0)
    ids = tf.constant(rng.randint(0, vocabulary_size, (8, 1024)).astype("int32"))
    inputs = dict(inputs, token_ids=ids, padding_mask=tf.ones((8, 1024), "int32"))

    def loss():
        h = backbone(inputs, training=True)
        if isinstance(h, dict):
            h = h["sequence_output"]
        logits = backbone.token_embedding(h, reverse=True)
        labels = ids
        if next_token:
            labels, logits = ids[:, 1:], logits[:, :-1]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    return loss, backbone.trainable_variables, {}


def _gpt2():
    import keras_hub  # pylint: disable=import-outside-toplevel
    return _transformer(keras_hub.models.GPT2Backbone, 50257, next_token=True)


def _bert():
    import keras_hub  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return _transformer(keras_hub.models.BertBackbone, 30522, next_token=False,
                        segment_ids=tf.zeros((8, 1024), "int32"))


BUILDERS = {"chain": _chain, "ResNet50": _resnet50, "GPT2": _gpt2, "BERT": _bert}
LABELS = {"chain": "chain 32 × tanh(h @ W), 256 units, batch 4096",
          "ResNet50": "Keras ResNet50, 224 px, batch 32",
          "GPT2": "keras-hub GPT2Backbone, 12 layers, 768 hidden, 1,024 tokens, batch 8, "
                  "next-token cross-entropy on the tied embedding's logits",
          "BERT": "keras-hub BertBackbone, 12 layers, 768 hidden, 1,024 tokens, batch 8, "
                  "each token's cross-entropy on the tied embedding's logits"}


def _step(loss, variables, checkpoints=None, options=None):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import memsave  # pylint: disable=import-outside-toplevel

    def step():
        tape = (tf.GradientTape() if checkpoints is None
                else memsave.GradientTape(checkpoints=checkpoints, **(options or {})))
        with tape:
            value = loss()
        return tape.gradient(value, variables)

    return tf.function(step, jit_compile=True)


def _device_peak(step):
    """The GPU allocator's peak over one run of ``step``, MiB; None without a GPU."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if not tf.config.list_physical_devices("GPU"):
        return None
    tf.config.experimental.reset_memory_stats("GPU:0")
    before = tf.config.experimental.get_memory_info("GPU:0")["current"]
    step()
    return (tf.config.experimental.get_memory_info("GPU:0")["peak"] - before) / MIB


def _jax_chain_rows():
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    c = CHAIN

    def layers(h, weights):
        for w in weights:
            h = jnp.tanh(h @ w)
        return h

    rows = []
    for prevent_cse in (True, False):
        def loss(ws, x, prevent_cse=prevent_cse):
            h = x
            for i in range(0, c["layers"], c["segment"]):
                h = jax.checkpoint(layers, prevent_cse=prevent_cse)(h, ws[i:i + c["segment"]])
            return jnp.sum(h ** 2)

        specs = ([jax.ShapeDtypeStruct((c["units"], c["units"]), jnp.float32)] * c["layers"],
                 jax.ShapeDtypeStruct((c["batch"], c["units"]), jnp.float32))
        lowered = jax.jit(jax.grad(loss)).trace(*specs).lower(lowering_platforms=("cuda",))
        executable = xla_gpu.compile_stablehlo(lowered.as_text())
        rows.append(dict(_figures(executable),
                         config="jax.checkpoint (4 layers, prevent_cse=%s)" % prevent_cse))
    return rows


def _figures(executable):
    """A compiled step's temp and whole-step MiB (temp, arguments and outputs),
    matmul FLOPs and roofline seconds (see :mod:`benchmarks.xla_gpu`)."""
    memory = xla_gpu.memory(executable)
    return {"temp_mib": memory["temp"] / MIB,
            "step_mib": (memory["temp"] + memory["argument"] + memory["output"]
                         - memory["alias"]) / MIB,
            "matmul_flops": xla_gpu.matmul_flops(executable),
            "roofline_s": xla_gpu.roofline_seconds(executable)}


def measure(name):
    """Rows ``{model, config, temp_mib, build_s, device_peak_mib}`` for one model."""
    loss, variables, peers = BUILDERS[name]()
    configs = [("plain", None, None)]
    configs += [(k, None, None) for k in peers]
    configs += [(s + "".join(", %s=%s" % kv for kv in o.items()), s, o) for s, o in STRATEGIES]
    rows = []
    for label, checkpoints, options in configs:
        print("%s: %s" % (name, label), file=sys.stderr, flush=True)
        start = time.perf_counter()
        step = _step(peers.get(label, loss), variables, checkpoints, options)
        try:
            hlo = step.experimental_get_compiler_ir()(stage="hlo_serialized")
        except Exception as e:  # pylint: disable=broad-except
            rows.append({"model": name, "config": label, "error": error_line(e)})
            continue
        build = time.perf_counter() - start
        rows.append(dict(_figures(xla_gpu.compile_hlo(hlo)), model=name, config=label,
                         build_s=build, device_peak_mib=_device_peak(step)))
    if name == "chain":
        rows += [dict(r, model=name, build_s=None, device_peak_mib=None)
                 for r in _jax_chain_rows()]
    return rows


def markdown(rows):
    lines = ["XLA's buffer assignment for one training step (loss and gradients in "
             "`tf.function(jit_compile=True)`, float32), compiled for an NVIDIA H100 by XLA's "
             "GPU compiler on a CPU (`python -m benchmarks.xla`). Temp: XLA's buffers for "
             "intermediates, MiB (weights, inputs and gradients are arguments and outputs, the "
             "same in every row); deterministic, one compile per row. 'vs plain': temp against "
             "plain XLA's; step memory: temp, arguments and outputs against plain's; matmul "
             "FLOPs: of the compiled step's matmuls against plain's (what XLA recomputes); "
             "H100 time: a roofline estimate of the compiled step against plain's (each kernel "
             "at the longer of its matmul FLOPs at the tensor cores' peak and its bytes at HBM "
             "bandwidth, plus a launch: a model, not a measurement; see "
             "`benchmarks/xla_gpu.py`); both blank where convolutions, run by cuDNN, are not "
             "counted; build: trace and rewrite, seconds.", ""]
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        plain = next(r for r in mine if r["config"] == "plain")
        gpu = any(r.get("device_peak_mib") is not None for r in mine)
        lines += ["**%s**" % name, "", LABELS[name], "",
                  "| config | temp MiB | vs plain | step memory vs plain | matmul FLOPs vs plain "
                  "| H100 time vs plain (roofline) | build s |"
                  + (" GPU peak MiB |" if gpu else ""),
                  "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if gpu else "")]
        for r in mine:
            if "error" in r:
                lines.append("| %s | raises: %s | | | | | |" % (r["config"], r["error"]))
                continue
            lines.append("| %s | %.1f | %.0f%% | %s | %s | %s | %s |%s" % (
                r["config"], r["temp_mib"], 100.0 * r["temp_mib"] / plain["temp_mib"],
                _ratio(r, plain, "step_mib", "%.0f%%", 100.0),
                _ratio(r, plain, "matmul_flops", "%.3f×"),
                _ratio(r, plain, "roofline_s", "%.3f×"),
                "%.1f" % r["build_s"] if r.get("build_s") is not None else "",
                (" %.1f |" % r["device_peak_mib"] if r.get("device_peak_mib") is not None
                 else " |") if gpu else ""))
        lines.append("")
    return "\n".join(lines)


def _ratio(row, plain, key, form, scale=1.0):
    """``row[key]`` against plain's, formatted; blank where either is missing."""
    if not row.get(key) or not plain.get(key):
        return ""
    return form % (scale * row[key] / plain[key])


def plot(rows, path):
    from benchmarks.plotting import model_panels  # pylint: disable=import-outside-toplevel
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = model_panels(models, 4.6, 3.8)
    for ax, name in zip(axes, models):
        mine = [r for r in rows if r["model"] == name and "temp_mib" in r]
        ax.barh([r["config"] for r in mine], [r["temp_mib"] for r in mine],
                color=["grey" if r["config"] == "plain" else "tab:blue"
                       if r["config"].split(",")[0] in dict(STRATEGIES) else "tab:orange"
                       for r in mine])
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(name)
        ax.set_xlabel("XLA temp MiB (H100, deviceless)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    args = cli.parse(parser, argv)
    if not xla_gpu.available():
        print("benchmarks.xla needs the xla extra: pip install -e '.[xla]'", file=sys.stderr)
        return 2
    rows = []
    for name in args.models.split(","):
        rows += measure(name)
    out = cli.write(args.out, "xla", {"rows": rows, "chain": CHAIN}, markdown(rows))
    plot(rows, out / "xla.png")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
