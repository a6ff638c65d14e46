"""Copy the measured tables of ``benchmarks/results/*.md`` into the docs.

Run ``python -m benchmarks.tables`` to rewrite every generated block in
``README.md`` and ``docs/*.md``, or ``python -m benchmarks.tables --check``
to list the stale ones (exit status 1 if any; nothing is written). No
TensorFlow is imported.

A generated block sits between two marker lines::

    <!-- table: SPEC -->
    ... (replaced) ...
    <!-- /table -->

and becomes the opening marker, a blank line, the selected text, a blank
line and the closing marker. ``SPEC`` is ``NAME[#SECTION][?COLUMN=V1|V2...]``:

* ``NAME`` selects the whole of ``benchmarks/results/NAME.md``.
* ``#SECTION`` selects one section of a results file that holds several
  tables. A section starts at a line that begins with ``**SECTION**`` (the
  bold label the benchmark writes above each table, e.g. ``**unet**`` in
  ``models.md``, ``**chain**`` in ``depth.md``) and runs up to the next line
  that begins with ``**`` or the end of the file, so notes that follow the
  last table of a file belong to the last section. Text before the first
  label belongs to no section.
* ``?COLUMN=V1|V2`` keeps, in every table of the selection, the header, the
  separator and only those rows whose cell in column ``COLUMN`` (a header
  name) is exactly one of the values, in file order; text outside tables is
  kept. Values are separated by ``|`` and may contain spaces and commas.

Leading and trailing blank lines of the selection are dropped. A missing
results file, an unknown section or column, and an unclosed or nested
marker are errors (exit status 2), in both modes.
"""

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

OPEN = re.compile(r"^<!-- table: (?P<spec>.+?) -->\s*$")
CLOSE = re.compile(r"^<!-- /table -->\s*$")
SPEC = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)(?:#(?P<section>[^?]+))?"
                  r"(?:\?(?P<column>[^=]+)=(?P<values>.+))?$")


class TableError(ValueError):
    """A marker or a spec that cannot be resolved."""


def doc_files(root=ROOT):
    """The files whose blocks are generated: README.md and docs/*.md."""
    files = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    return [f for f in files if f.is_file()]


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _section(lines, section, where):
    label = "**%s**" % section
    start = next((i for i, l in enumerate(lines) if l.startswith(label)), None)
    if start is None:
        raise TableError("%s: no section %r (a line starting with %s)" % (where, section, label))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("**")),
               len(lines))
    return lines[start:end]


def _filter(lines, column, values, where):
    out, header, found = [], None, False
    for line in lines:
        if not line.startswith("|"):
            header = None
            out.append(line)
            continue
        if header is None:
            header = _cells(line)
            if column in header:
                found = True
            out.append(line)
            continue
        if set(line.replace("|", "").strip()) <= set("-: "):
            out.append(line)   # separator row
            continue
        cells = _cells(line)
        if column not in header:
            out.append(line)
        elif header.index(column) < len(cells) and cells[header.index(column)] in values:
            out.append(line)
    if not found:
        raise TableError("%s: no table with a column %r" % (where, column))
    return out


def render(spec, results=RESULTS):
    """The text a block with this spec holds (without the markers)."""
    match = SPEC.match(spec.strip())
    if not match:
        raise TableError("bad table spec %r: use NAME[#SECTION][?COLUMN=V1|V2]" % spec)
    path = results / (match["name"] + ".md")
    if not path.is_file():
        raise TableError("table %r: no results file %s" % (spec, path))
    lines = path.read_text(encoding="utf-8").splitlines()
    if match["section"]:
        lines = _section(lines, match["section"].strip(), spec)
    if match["column"]:
        lines = _filter(lines, match["column"].strip(),
                        [v.strip() for v in match["values"].split("|")], spec)
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines)


def update_text(text, where="<text>", results=RESULTS):
    """(new text, [(line number, spec) of every block that changed])."""
    lines = text.split("\n")
    out, stale, i = [], [], 0
    while i < len(lines):
        opening = OPEN.match(lines[i])
        if CLOSE.match(lines[i]):
            raise TableError("%s:%d: <!-- /table --> without an opening marker" % (where, i + 1))
        if not opening:
            out.append(lines[i])
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not CLOSE.match(lines[end]):
            if OPEN.match(lines[end]):
                raise TableError("%s:%d: table marker inside another" % (where, end + 1))
            end += 1
        if end == len(lines):
            raise TableError("%s:%d: unclosed table marker" % (where, i + 1))
        spec = opening["spec"]
        block = [lines[i], "", render(spec, results), "", lines[end]]
        block = "\n".join(block).split("\n")
        if block != lines[i:end + 1]:
            stale.append((i + 1, spec))
        out.extend(block)
        i = end + 1
    return "\n".join(out), stale


def stale_blocks(root=ROOT, results=None):
    """['file:line: spec' for every block not in sync with its results file]."""
    results = results or root / "benchmarks" / "results"
    found = []
    for path in doc_files(root):
        rel = path.relative_to(root)
        _, stale = update_text(path.read_text(encoding="utf-8"), str(rel), results)
        found.extend("%s:%d: %s" % (rel, line, spec) for line, spec in stale)
    return found


def rewrite(root=ROOT, results=None):
    """Regenerate every block; returns the files that changed."""
    results = results or root / "benchmarks" / "results"
    changed = []
    for path in doc_files(root):
        text = path.read_text(encoding="utf-8")
        new, _ = update_text(text, str(path.relative_to(root)), results)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path.relative_to(root))
    return changed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="list stale blocks and exit 1 if any; write nothing")
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_blocks()
            for entry in stale:
                print("stale: %s" % entry)
            if stale:
                print("run `python -m benchmarks.tables` to regenerate them")
                return 1
            print("all generated tables are in sync with benchmarks/results/")
            return 0
        for path in rewrite():
            print("rewrote %s" % path)
        return 0
    except TableError as err:
        print("error: %s" % err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
