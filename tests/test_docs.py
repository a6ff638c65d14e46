"""The docs: generated tables in sync, links that resolve, a short README.

No TensorFlow here (``benchmarks.tables`` is plain Python).
"""

import pathlib
import re

import pytest

from benchmarks import tables

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = tables.doc_files(ROOT)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _prose(path):
    """The file's text without fenced code blocks."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def _anchors(path):
    """GitHub's heading anchors of a Markdown file."""
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", _prose(path), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def _relative_links():
    for path in DOCS:
        for target in LINK.findall(_prose(path)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                continue
            yield path, target


def test_the_docs_exist():
    names = {p.name for p in DOCS}
    assert "README.md" in names
    assert {"strategies.md", "guarantees.md", "benchmarks.md"} <= names


def test_generated_tables_are_in_sync_with_the_results():
    stale = tables.stale_blocks(ROOT)
    assert not stale, "run `python -m benchmarks.tables`; stale: %s" % stale


def test_every_measured_table_with_a_results_file_is_generated():
    used = set()
    for path in DOCS:
        used |= {m.split("#")[0].split("?")[0]
                 for m in re.findall(r"<!-- table: (.+?) -->", path.read_text(encoding="utf-8"))}
    # Smaller runs (make demo's depth_demo, zoo --quick) are scratch, not results.
    results = {p.stem for p in (ROOT / "benchmarks" / "results").glob("*.md")
               if not p.stem.endswith(("_demo", "_quick"))}
    assert results - used == set(), "results files shown nowhere: %s" % (results - used)


def test_relative_links_point_to_existing_files():
    broken = []
    for path, target in _relative_links():
        file_part = target.split("#")[0]
        if file_part and not (path.parent / file_part).exists():
            broken.append("%s: %s" % (path.relative_to(ROOT), target))
    assert not broken, broken


def test_anchors_of_markdown_links_exist():
    broken = []
    for path, target in _relative_links():
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part) if file_part else path
        if anchor and dest.suffix == ".md" and dest.exists() and anchor not in _anchors(dest):
            broken.append("%s: %s" % (path.relative_to(ROOT), target))
    assert not broken, broken


def test_readme_is_short_and_says_how_to_install():
    readme = ROOT / "README.md"
    assert readme.stat().st_size < 10_000, readme.stat().st_size
    assert re.search(r"^\s*pip install ", readme.read_text(encoding="utf-8"), re.M)


# benchmarks.tables itself, on a scratch tree.

RESULT = """Caption of the file.

**alpha** (a=1) - first

| method | peak |
|---|---:|
| plain | 10 |
| optimal | 4 |

note on alpha

**beta** (b=2)

| method | peak |
|---|---:|
| plain | 20 |
| memory | 9 |

shared footer
"""


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "results" / "r.md").write_text(RESULT, encoding="utf-8")
    return tmp_path


def test_render_whole_file_section_and_filter(tree):
    results = tree / "benchmarks" / "results"
    assert tables.render("r", results) == RESULT.strip()
    alpha = tables.render("r#alpha", results)
    assert alpha.startswith("**alpha**") and "note on alpha" in alpha and "beta" not in alpha
    beta = tables.render("r#beta", results)
    assert beta.startswith("**beta**") and beta.endswith("shared footer")
    rows = tables.render("r?method=plain|memory", results)
    assert "| plain | 10 |" in rows and "| memory | 9 |" in rows and "optimal" not in rows
    assert "|---|---:|" in rows and "Caption of the file." in rows
    with pytest.raises(tables.TableError):
        tables.render("r#gamma", results)
    with pytest.raises(tables.TableError):
        tables.render("missing", results)
    with pytest.raises(tables.TableError):
        tables.render("r?nocolumn=x", results)


def test_check_reports_stale_blocks_and_rewrite_fixes_them(tree):
    (tree / "README.md").write_text(
        "# t\n\n<!-- table: r#beta -->\nold\n<!-- /table -->\n\ntext\n", encoding="utf-8")
    (tree / "docs" / "a.md").write_text("no tables\n", encoding="utf-8")
    assert tables.stale_blocks(tree) == ["README.md:3: r#beta"]
    assert tables.rewrite(tree) == [pathlib.Path("README.md")]
    assert tables.stale_blocks(tree) == []
    text = (tree / "README.md").read_text(encoding="utf-8")
    assert "| memory | 9 |" in text and "old" not in text and text.endswith("\n\ntext\n")
    assert tables.rewrite(tree) == []


def test_malformed_markers_are_errors(tree):
    (tree / "README.md").write_text("<!-- table: r -->\nnever closed\n", encoding="utf-8")
    with pytest.raises(tables.TableError, match="unclosed"):
        tables.stale_blocks(tree)
    (tree / "README.md").write_text("<!-- /table -->\n", encoding="utf-8")
    with pytest.raises(tables.TableError, match="without an opening"):
        tables.stale_blocks(tree)
