"""XLA's GPU memory for a TensorFlow step, measured without a GPU.

XLA's GPU compiler runs on a CPU-only machine through JAX's CUDA plugin
("deviceless" ahead-of-time compilation for a named GPU). Its buffer
assignment is the memory the step would take on that GPU: on a real H100
the figures were the same (a 32-layer tanh chain: plain 132 MiB of temp
buffers, ``tf.recompute_grad`` 48). XLA's CPU compiler is no substitute:
its scheduler never lowers memory by recomputing.

Needs the ``xla`` extra (``pip install -e .[xla]``: jax, jaxlib and the
CUDA 12 plugin, no CUDA libraries). ``JAX_PLATFORMS=cpu`` must be set
before jax is imported, else the plugin looks for a GPU: importing this
module sets it unless it is set already.
"""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# GpuTargetConfigProto of an NVIDIA H100 SXM (80 GB), in text form.
H100 = pathlib.Path(__file__).with_name("h100.txtpb")


def available():
    """Whether the ``xla`` extra is installed (jax with its CUDA plugin)."""
    try:
        import jax  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        from jax.experimental import topologies  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        import jax_plugins.xla_cuda12  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        return False
    return True


_devices = {}


def gpu_device(target=H100):
    """A device description of the GPU in ``target`` (compiles, never runs)."""
    key = str(target)
    if key not in _devices:
        from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
        _devices[key] = topologies.get_topology_desc(
            platform="cuda", topology="1x1x1",
            target_config=pathlib.Path(target).read_text()).devices[0]
    return _devices[key]


def _importable(hlo_bytes):
    """The module with each ``copy`` replaced by a unary op of the same shape.

    jaxlib's HLO -> StableHLO import rejects ``copy`` (Keras steps return
    copies). ``negate`` (``not`` for booleans) makes a buffer of the same
    size in the same place, so buffer assignment is unchanged; what the
    module computes does not matter here.
    """
    from tensorflow.compiler.xla.service import hlo_pb2  # pylint: disable=import-outside-toplevel
    module = hlo_pb2.HloModuleProto()
    module.ParseFromString(hlo_bytes)
    for computation in module.computations:
        for instruction in computation.instructions:
            if instruction.opcode == "copy":
                boolean = instruction.shape.element_type == 1     # PRED
                instruction.opcode = "not" if boolean else "negate"
    return module.SerializeToString()


def hlo_memory(hlo_bytes, device=None):
    """Bytes of a serialized HLO module compiled for ``device`` (default: H100):
    ``temp`` (XLA's buffers for intermediates: what checkpointing lowers),
    ``argument``, ``output`` and ``alias``."""
    from jax._src.lib import xla_client  # pylint: disable=import-outside-toplevel
    return stablehlo_memory(xla_client._xla.mlir.hlo_to_stablehlo(_importable(hlo_bytes)),  # pylint: disable=protected-access
                            device)


def stablehlo_memory(module_text, device=None):
    """:func:`hlo_memory` of a StableHLO module (text or bytecode), e.g. JAX's
    ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",)).as_text()``."""
    from jax._src.interpreters import mlir  # pylint: disable=import-outside-toplevel
    from jax._src.lib import xla_client  # pylint: disable=import-outside-toplevel
    from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
    device = device or gpu_device()
    with mlir.make_ir_context():
        module = ir.Module.parse(module_text)
        executable = device.client.compile(
            module, executable_devices=xla_client.DeviceList((device,)),
            compile_options=xla_client.CompileOptions())
    stats = executable.get_compiled_memory_stats()
    return {"temp": stats.temp_size_in_bytes, "argument": stats.argument_size_in_bytes,
            "output": stats.output_size_in_bytes, "alias": stats.alias_size_in_bytes}


def step_memory(function, *args, device=None):
    """:func:`hlo_memory` of ``function`` (a ``tf.function(jit_compile=True)``)
    traced for ``args``."""
    hlo = function.experimental_get_compiler_ir(*args)(stage="hlo_serialized")
    return hlo_memory(hlo, device)
