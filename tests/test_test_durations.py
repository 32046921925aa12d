"""tools/test_durations.py: docs/tests.md's table of the slowest tests, from a JUnit file."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import test_durations as td  # noqa: E402

JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="pytest">
<testcase classname="tests.a" name="test_fast" time="0.5"/>
<testcase classname="tests.a" name="test_slow" time="12.34"/>
<testcase classname="tests.b" name="test_bad" time="3.0"><failure message="x"/></testcase>
<testcase classname="tests.b" name="test_skip" time="0.0"><skipped message="y"/></testcase>
</testsuite></testsuites>"""


def test_the_slowest_come_first_with_the_totals_and_the_files(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text(JUNIT)
    text = td.table(td.cases(junit), top=2, wall=90, what="run")
    assert text.startswith("run: 4 tests (1 failed, 2 passed, 1 skipped); the tests' own seconds add up to 16 s, "
                           "wall 90 s (1.5 min)")
    rows = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert rows[:2] == ["| `tests/a.py::test_slow` | 12.3 |", "| `tests/b.py::test_bad` | 3.0 |"]
    assert rows[2:] == ["| `tests/a.py` | 12.8 |", "| `tests/b.py` | 3.0 |"]


def test_write_replaces_only_what_is_below_the_marker(tmp_path, capsys):
    junit, doc = tmp_path / "j.xml", tmp_path / "tests.md"
    junit.write_text(JUNIT)
    doc.write_text(f"# Tests\nkept\n{td.MARKER}\nold table\n")
    assert td.main([str(junit), "--write", str(doc), "--what", "now"]) == 0
    text = doc.read_text()
    assert text.startswith(f"# Tests\nkept\n{td.MARKER}\n\nnow: 4 tests") and "old table" not in text
    doc.write_text("# no marker\n")
    assert td.main([str(junit), "--write", str(doc)]) == 2
    assert "no line" in capsys.readouterr().err and doc.read_text() == "# no marker\n"
