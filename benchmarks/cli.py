"""What the benchmark scripts share: their environment, output folder and command line.

* ``environment()`` sets, unless the caller has set them already,
  ``TF_CPU_ALLOCATOR_USE_BFC=true`` (the BFC allocator on the CPU, whose peak
  ``memsave.profile.peak_memory`` reads) and ``TF_CPP_MIN_LOG_LEVEL=2``. A
  script calls it before it imports TensorFlow; child processes inherit both.
* ``RESULTS`` is ``benchmarks/results/``, the default ``--out`` of every script.
* ``parser(doc)`` and ``parse(parser, argv)`` build a script's command line:
  the first line of its docstring as the description, its own options, then
  ``--out``. ``write(out, stem, data, table)`` writes a run's
  ``STEM.{json,md}``; ``report(result, name, out)`` prints a result's
  Markdown table and where its ``NAME.{json,md}`` went.

No TensorFlow is imported here.
"""

import argparse
import json
import os
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def environment():
    """The allocator and logging settings every benchmark measures under
    (set before TensorFlow loads; a value already in the environment stays)."""
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parser(doc):
    """An ArgumentParser described by the first line of ``doc`` (the script's docstring)."""
    return argparse.ArgumentParser(description=doc.splitlines()[0])


def parse(arguments, argv=None):
    """Add ``--out`` (default ``RESULTS``) as the last option of ``arguments``
    and parse ``argv`` (``None``: the command line)."""
    arguments.add_argument("--out", default=str(RESULTS))
    return arguments.parse_args(argv)


def write(out, stem, data, table):
    """Write ``data`` as ``OUT/STEM.json`` (indented JSON) and the Markdown
    ``table`` as ``OUT/STEM.md``, making the folder ``out`` if missing; return
    it as a ``pathlib.Path`` (for the plots that go beside them)."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / (stem + ".json")).write_text(json.dumps(data, indent=1))
    (out / (stem + ".md")).write_text(table)
    return out


def report(result, name, out):
    """Print ``result["markdown"]`` and a line naming ``NAME.{json,md}`` in
    ``out`` and the run's seconds (``result["meta"]["seconds"]``)."""
    print(result["markdown"])
    print("wrote %s.{json,md} in %s (%.0f s)" % (name, out, result["meta"]["seconds"]))
