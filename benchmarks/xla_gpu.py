"""XLA's GPU memory (and matmul FLOPs) for a TensorFlow step, measured without a GPU.

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
import re

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
    return memory(compile_hlo(hlo_bytes, device))


def compile_hlo(hlo_bytes, device=None):
    """A serialized HLO module compiled for ``device`` (default: H100)."""
    from jax._src.lib import xla_client  # pylint: disable=import-outside-toplevel
    stablehlo = xla_client._xla.mlir.hlo_to_stablehlo(_importable(hlo_bytes))  # pylint: disable=protected-access
    return compile_stablehlo(stablehlo, device)


def stablehlo_memory(module_text, device=None):
    """:func:`hlo_memory` of a StableHLO module (text or bytecode), e.g. JAX's
    ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",)).as_text()``."""
    return memory(compile_stablehlo(module_text, device))


def compile_stablehlo(module_text, device=None):
    """A StableHLO module (text or bytecode) compiled for ``device`` (default: H100)."""
    from jax._src.interpreters import mlir  # pylint: disable=import-outside-toplevel
    from jax._src.lib import xla_client  # pylint: disable=import-outside-toplevel
    from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
    device = device or gpu_device()
    with mlir.make_ir_context():
        module = ir.Module.parse(module_text)
        return device.client.compile(
            module, executable_devices=xla_client.DeviceList((device,)),
            compile_options=xla_client.CompileOptions())


def memory(executable):
    """The byte counts of :func:`hlo_memory` for a compiled executable."""
    stats = executable.get_compiled_memory_stats()
    return {"temp": stats.temp_size_in_bytes, "argument": stats.argument_size_in_bytes,
            "output": stats.output_size_in_bytes, "alias": stats.alias_size_in_bytes}


_DEFINED = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]")
_PARAMETER = re.compile(r"([\w.\-]+): \w+\[([\d,]*)\]")
_DOT = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), "
                  r".*lhs_contracting_dims=\{([\d,]*)\}")


def matmul_flops(executable):
    """FLOPs of the matmuls (``dot``, fused or not) in the compiled step's
    HLO: 2 x output elements x contracted elements each. The deviceless
    executable has no cost analysis; its HLO shows what XLA recomputes after
    dead-code elimination and CSE. None where the step has convolutions
    (cuDNN calls, not counted here)."""
    text = executable.hlo_modules()[0].to_string()
    if "__cudnn$conv" in text:
        return None
    shapes, total = {}, 0
    for line in text.splitlines():
        dot = _DOT.match(line)
        if dot:
            flops = 2
            for d in _dims(dot.group(1)):
                flops *= d
            lhs = shapes[dot.group(2)]
            for axis in _dims(dot.group(3)):
                flops *= lhs[axis]
            total += flops
        defined = _DEFINED.match(line)
        if defined:
            shapes[defined.group(1)] = _dims(defined.group(2))
        elif line.startswith("%") or line.startswith("ENTRY"):   # a computation's parameters
            shapes.update((n, _dims(d)) for n, d in _PARAMETER.findall(line.split("->")[0]))
    return total


def _dims(text):
    return [int(d) for d in text.split(",") if d]


def step_memory(function, *args, device=None):
    """:func:`hlo_memory` of ``function`` (a ``tf.function(jit_compile=True)``)
    traced for ``args``."""
    hlo = function.experimental_get_compiler_ir(*args)(stage="hlo_serialized")
    return hlo_memory(hlo, device)
