"""XLA's GPU memory (and matmul FLOPs, and a roofline time) for a TensorFlow step,
without a GPU.

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

import collections
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


# One instruction of an HLO module's text: its name, result shape (an array
# or a tuple of them), opcode, operand names and the rest of the line.
Instruction = collections.namedtuple("Instruction", "name shape opcode operands attributes")

_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_SIGNATURE_PARAMETER = re.compile(r"([\w.\-]+): (\w+\[[\d,]*\](?:\{[^}]*\})?|\([^)]*\))")
_CALLED = re.compile(r"(?:calls|to_apply)=%([\w.\-]+)")
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                  "c128": 16, "token": 0}


def parse_hlo(text):
    """``({computation name: {instruction name: Instruction}}, entry name)``
    of an HLO module's text (``executable.hlo_modules()[0].to_string()``)."""
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = computations.setdefault(header.group(2), {})
            if header.group(1):
                entry = header.group(2)
            signature = line[line.index("("):line.rindex("->")]
            for name, shape in _SIGNATURE_PARAMETER.findall(signature):
                current[name] = Instruction(name, shape, "parameter", [], "")
            continue
        line = line.strip()
        if current is None or not line.startswith(("%", "ROOT %")):
            continue
        name, rest = line[line.index("%") + 1:].split(" = ", 1)
        if rest.startswith("("):
            end = _closing(rest, 0)
            shape, rest = rest[:end + 1], rest[end + 2:]
        else:
            shape, rest = rest.split(" ", 1)
        opcode, rest = rest.split("(", 1)
        end = _closing(rest, -1)
        current[name] = Instruction(name, shape, opcode, re.findall(r"%([\w.\-]+)", rest[:end]),
                                    rest[end + 1:])
    return computations, entry


def _closing(text, start):
    """Index of the bracket closing the one at ``start`` (-1: one opened before ``text``)."""
    depth = 1 if start < 0 else 0
    for i in range(max(start, 0), len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def shape_bytes(shape):
    """Bytes of an HLO shape (an array, or a tuple: the sum of its arrays)."""
    total = 0
    for element, dims in _ARRAY.findall(re.sub(r"\{[^}]*\}", "", shape)):
        total += _ELEMENT_BYTES.get(element, 4) * _product(_dims(dims))
    return total


def _dot_flops(instruction, computation):
    """2 x output elements x contracted elements."""
    lhs = _dims(_ARRAY.match(computation[instruction.operands[0]].shape).group(2))
    contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attributes)
    return 2 * _product(_dims(_ARRAY.match(instruction.shape).group(2))) * _product(
        lhs[axis] for axis in _dims(contracted.group(1)))


def _own_dot_flops(computation):
    """``{element type: FLOPs}`` of the dots in one computation."""
    total = collections.Counter()
    for instruction in computation.values():
        if instruction.opcode == "dot":
            total[instruction.shape.split("[")[0]] += _dot_flops(instruction, computation)
    return total


def _called_dot_flops(computations, name, memo):
    """:func:`_own_dot_flops` of computation ``name`` and of those it calls."""
    if name not in memo:
        total = _own_dot_flops(computations[name])
        for instruction in computations[name].values():
            for called in _CALLED.findall(instruction.attributes):
                total.update(_called_dot_flops(computations, called, memo))
        memo[name] = total
    return memo[name]


def matmul_flops(executable):
    """FLOPs of the matmuls (``dot``, fused or not) in the compiled step's
    HLO: 2 x output elements x contracted elements each. The deviceless
    executable has no cost analysis; its HLO shows what XLA recomputes after
    dead-code elimination and CSE. None where the step has convolutions
    (cuDNN calls, not counted here)."""
    text = executable.hlo_modules()[0].to_string()
    if "__cudnn$conv" in text:
        return None
    computations, _ = parse_hlo(text)
    return sum(sum(_own_dot_flops(c).values()) for c in computations.values())


# The roofline's figures for an H100 SXM (NVIDIA's datasheet, dense): dots at
# the tensor cores' peak (float32 runs as TF32, TensorFlow's default), bytes
# at HBM's bandwidth (the target's memory_bandwidth), and a kernel launch.
DOT_FLOPS_PER_SECOND = {"f32": 494.7e12, "bf16": 989.4e12, "f16": 989.4e12, "f64": 66.9e12}
LAUNCH_SECONDS = 2e-6
# Instructions that run no kernel: views, tuples, inputs.
_NO_KERNEL = frozenset({"parameter", "constant", "bitcast", "get-tuple-element", "tuple",
                        "opt-barrier", "after-all", "partition-id", "replica-id"})


def roofline_seconds(executable, target=H100):
    """Estimated run time of a compiled step on an H100, seconds.

    The deviceless executable has no cost analysis and cannot run, so this
    is a roofline over the kernels XLA emitted: each top-level instruction
    (a fusion, a library call, a copy; a while loop's body times its known
    trip count, once where none is known) takes the longer of its dots'
    FLOPs at the tensor cores' peak (:data:`DOT_FLOPS_PER_SECOND`) and the
    bytes of its operands and results at ``target``'s memory bandwidth,
    plus a launch. What it weighs right is where a recomputation's time goes
    on a GPU: an elementwise or softmax kernel costs its bytes, which FLOPs
    do not see. Ideal rates, no overlap between kernels, operands counted
    whole where a kernel reads a slice; None where the step has
    convolutions (cuDNN calls, whose FLOPs are not counted here).
    """
    text = executable.hlo_modules()[0].to_string()
    if "__cudnn$conv" in text:
        return None
    bandwidth = float(re.search(r"memory_bandwidth: (\d+)",
                                pathlib.Path(target).read_text()).group(1))
    computations, entry = parse_hlo(text)
    return _computation_seconds(computations, entry, bandwidth, {})


def _computation_seconds(computations, name, bandwidth, memo):
    computation, total = computations[name], 0.0
    for instruction in computation.values():
        if instruction.opcode in _NO_KERNEL:
            continue
        if instruction.opcode == "while":
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.attributes)
            body = re.search(r"body=%([\w.\-]+)", instruction.attributes).group(1)
            total += (int(trips.group(1)) if trips else 1) * _computation_seconds(
                computations, body, bandwidth, memo)
            continue
        flops = collections.Counter()
        if instruction.opcode == "dot":
            flops[instruction.shape.split("[")[0]] += _dot_flops(instruction, computation)
        for called in _CALLED.findall(instruction.attributes):
            flops.update(_called_dot_flops(computations, called, memo))
        moved = shape_bytes(instruction.shape) + sum(
            shape_bytes(computation[operand].shape)
            for operand in dict.fromkeys(instruction.operands))
        compute = sum(f / DOT_FLOPS_PER_SECOND.get(element, DOT_FLOPS_PER_SECOND["f64"])
                      for element, f in flops.items())
        total += max(compute, moved / bandwidth) + LAUNCH_SECONDS
    return total


def _dims(text):
    return [int(d) for d in text.split(",") if d]


def _product(values):
    out = 1
    for v in values:
        out *= v
    return out


def step_memory(function, *args, device=None):
    """:func:`hlo_memory` of ``function`` (a ``tf.function(jit_compile=True)``)
    traced for ``args``."""
    hlo = function.experimental_get_compiler_ir(*args)(stage="hlo_serialized")
    return hlo_memory(hlo, device)
