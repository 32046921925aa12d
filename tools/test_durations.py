"""The suite's slowest tests and its total, from a pytest JUnit XML file, as docs/tests.md's table.

    make test-durations                                  # runs make test, then rewrites docs/tests.md's table
    python tools/test_durations.py build/test-durations.xml --wall 1130 --write docs/tests.md

A test's seconds are pytest's (its setup, call and teardown: a shared run's cost lands on the first test that
asks for it). ``--write`` replaces everything below the file's marker line; without it the table is printed.
A tool, not a test.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_conditions import cpu_info

MARKER = "<!-- durations: tools/test_durations.py writes below -->"


def cases(junit: Path) -> list[tuple[str, float, str]]:
    """(test id, seconds, outcome) of every test case in the file."""
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        out.append((f"{path}::{case.get('name')}", float(case.get("time", 0)), outcome))
    return out


def table(rows: list[tuple[str, float, str]], top: int, wall: float | None, what: str) -> str:
    """The markdown: a heading line of totals, the ``top`` slowest tests, then the slowest files."""
    total, cpu = sum(s for _, s, _ in rows), cpu_info()
    outcomes = Counter(o for _, _, o in rows)
    said = {"passed": "passed", "failure": "failed", "error": "errors", "skipped": "skipped"}
    counts = ", ".join(f"{n} {said[o]}" for o, n in sorted(outcomes.items()))
    files: Counter[str] = Counter()
    for name, s, _ in rows:
        files[name.split("::")[0]] += s
    lines = [f"{what}: {len(rows)} tests ({counts}); the tests' own seconds add up to {total:,.0f} s"
             + (f", wall {wall:,.0f} s ({wall / 60:.1f} min)" if wall else "") + f"; {cpu['model']}, "
             f"{cpu['cores']} cores.", "",
             f"| the {top} slowest tests | s |", "|---|---:|"]
    lines += [f"| `{name}` | {s:.1f} |" for name, s, _ in sorted(rows, key=lambda r: -r[1])[:top]]
    lines += ["", "| the 15 slowest files | s |", "|---|---:|"]
    lines += [f"| `{f}` | {s:.1f} |" for f, s in files.most_common(15)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", type=Path)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--what", default=None, help="the table's first words (default: `make test` on <today>)")
    p.add_argument("--wall", type=float, help="the whole run's wall seconds (make test-durations measures them)")
    p.add_argument("--write", type=Path, help="the Markdown file whose part below the marker line is replaced")
    args = p.parse_args(argv)
    today = datetime.date.today().isoformat()
    text = table(cases(args.junit), args.top, args.wall, args.what or f"`make test` on {today}")
    if not args.write:
        print(text, end="")
        return 0
    doc = args.write.read_text()
    if MARKER not in doc:
        print(f"{args.write}: no line {MARKER!r} to write below", file=sys.stderr)
        return 2
    args.write.write_text(doc[:doc.index(MARKER) + len(MARKER)] + "\n\n" + text)
    print(f"{args.write}: the table of {args.junit} written below its marker")
    return 0


if __name__ == "__main__":
    sys.exit(main())
