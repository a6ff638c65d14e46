"""The deviceless XLA figures against a real GPU: the same HLO compiled on both.

Two steps, on two machines:

    python -m benchmarks.xla_device export DIR      # here: TensorFlow, the xla extra
    python3 benchmarks/xla_device.py run DIR        # on the GPU machine: JAX only

``export`` writes the serialized HLO of plain and memsave ('optimal') train
steps of :mod:`benchmarks.xla`'s chain and ResNet50 (224 px, batch 32; its
``copy`` instructions made importable, see :mod:`benchmarks.xla_gpu`), their
parameter shapes, and the temp bytes XLA's GPU compiler gives for an H100
without a GPU. ``run`` compiles each module for the machine's GPU (with
autotuning, which the deviceless compile cannot do) and writes
``DIR/xla_device.json``: deviceless and device temp MiB per step. It
imports neither TensorFlow nor memsave, so it runs where only JAX is.

GPT2's step is left out: its HLO (about 100 MB, constants included) is
larger than what travels to the lent machine.
"""

import glob
import json
import os
import sys

MIB = 2.0 ** 20
MODELS = ("chain", "ResNet50")
PRIMITIVES = {1: "bool", 2: "int8", 4: "int32", 5: "int64", 6: "uint8", 8: "uint32",
              10: "float16", 11: "float32", 12: "float64", 16: "bfloat16"}


def export(folder):
    """Write each step's HLO, ``params.json`` and ``deviceless.json`` to ``folder``."""
    from benchmarks import cli  # pylint: disable=import-outside-toplevel
    cli.environment()
    from benchmarks import xla, xla_gpu  # pylint: disable=import-outside-toplevel
    from tensorflow.compiler.xla.service import hlo_pb2  # pylint: disable=C0415
    os.makedirs(folder, exist_ok=True)
    deviceless, params = {}, {}
    for model in MODELS:
        loss, variables, _ = xla.BUILDERS[model]()
        for label, checkpoints in (("plain", None), ("optimal", "optimal")):
            hlo = xla._step(loss, variables, checkpoints).experimental_get_compiler_ir()(  # pylint: disable=W0212
                stage="hlo_serialized")
            name = "%s_%s.pb" % (model, label)
            data = xla_gpu._importable(hlo)  # pylint: disable=protected-access
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
            module = hlo_pb2.HloModuleProto()
            module.ParseFromString(data)
            params[name] = [(list(s.dimensions), PRIMITIVES[s.element_type])
                            for s in module.host_program_shape.parameters]
            deviceless[name] = xla_gpu.hlo_memory(hlo)["temp"] / MIB
            print("%s: deviceless H100 temp %.1f MiB" % (name, deviceless[name]))
    for stem, data in (("params", params), ("deviceless", deviceless)):
        with open(os.path.join(folder, stem + ".json"), "w") as f:
            json.dump(data, f, indent=1)


def run(folder):
    """Compile each exported step for this machine's GPU; write ``xla_device.json``."""
    import jax  # pylint: disable=import-outside-toplevel
    from jax._src.interpreters import mlir  # pylint: disable=import-outside-toplevel
    from jax._src.lib import xla_client  # pylint: disable=import-outside-toplevel
    from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
    with open(os.path.join(folder, "deviceless.json")) as f:
        deviceless = json.load(f)
    device = jax.devices()[0]
    result = {"device": device.device_kind, "jax": jax.__version__, "steps": {}}
    for path in sorted(glob.glob(os.path.join(folder, "*.pb"))):
        name = os.path.basename(path)
        with open(path, "rb") as f:
            stablehlo = xla_client._xla.mlir.hlo_to_stablehlo(f.read())  # pylint: disable=W0212
        with mlir.make_ir_context():
            compile_ = getattr(device.client, "compile_and_load", None) or device.client.compile
            executable = compile_(ir.Module.parse(stablehlo),
                                  executable_devices=xla_client.DeviceList((device,)),
                                  compile_options=xla_client.CompileOptions())
        temp = executable.get_compiled_memory_stats().temp_size_in_bytes / MIB
        result["steps"][name] = {"deviceless_temp_mib": deviceless[name], "device_temp_mib": temp}
        print("%s: deviceless %.1f MiB, %s %.1f MiB" % (name, deviceless[name],
                                                         device.device_kind, temp))
    with open(os.path.join(os.environ.get("OUT", folder), "xla_device.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("export", "run"):
        sys.exit("usage: xla_device.py export|run DIR")
    (export if sys.argv[1] == "export" else run)(sys.argv[2])
