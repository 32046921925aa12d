"""Print the project's pinned runtime dependencies from pyproject.toml, one per line.

    python3 tools/image/deps.py [pyproject.toml] [--extra test]

Used by the Dockerfile (dependencies get their own cached layer) and tools/image/wheels.sh.
"""
from __future__ import annotations

import sys
from pathlib import Path

import tomllib


def deps(pyproject: Path, extras: list[str]) -> list[str]:
    """[project] dependencies plus the named optional-dependency groups."""
    project = tomllib.loads(pyproject.read_text())["project"]
    out = list(project.get("dependencies", []))
    for extra in extras:
        out += project.get("optional-dependencies", {}).get(extra, [])
    return out


def main(argv: list[str]) -> int:
    extras = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--extra"]
    paths = [a for i, a in enumerate(argv) if a != "--extra" and (i == 0 or argv[i - 1] != "--extra")]
    pyproject = Path(paths[0]) if paths else Path(__file__).resolve().parents[2] / "pyproject.toml"
    print("\n".join(deps(pyproject, extras)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
