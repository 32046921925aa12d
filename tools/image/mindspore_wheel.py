"""Which MindSpore wheel pip installs in the image, for the image's own Python and machine.

    python tools/image/mindspore_wheel.py PYPROJECT [MINDSPORE_WHEEL]            # print pip's argument
    python tools/image/mindspore_wheel.py PYPROJECT [MINDSPORE_WHEEL] --failed   # say what to supply; exit 1
    python tools/image/mindspore_wheel.py PYPROJECT "" --python cp311 --arch aarch64   # for another image

PyPI's mindspore 2.10.0 is tagged py3-none-any but holds x86-64 libraries, so on x86_64 pip's own pick is
right (empty output) and on aarch64 (Atlas 800T A2) the wheel comes from MindSpore's release repository,
whose URL pattern (as MindSpore's install page and Ascend's ascend-deployer list it for each release) is
:data:`RELEASE_URL`. ``MINDSPORE_WHEEL`` (a URL or a file) overrides it; a file whose name says another
version, Python or machine is refused before pip runs; a fitting wheel in ``PIP_FIND_LINKS`` (the offline
build's directory, tools/image/wheels.sh) is taken before the URL. Run by the Dockerfile with the image's
Python, and by wheels.sh for the image's (``--python``, ``--arch``).
"""
from __future__ import annotations

import platform
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deps import deps  # the sibling script (both are copied to /tmp/deps by the Dockerfile)

RELEASE_URL = ("https://ms-release.obs.cn-north-4.myhuaweicloud.com/{version}/MindSpore/unified/{arch}/"
               "mindspore-{version}-{py}-{py}-linux_{arch}.whl")
WHEEL_NAME = re.compile(r"mindspore-(?P<version>[^-]+)-(?P<py>cp\d+)-(?:cp\d+|abi3|none)-(?P<platform>[\w.]+)\.whl$")


def pinned_version(pyproject: Path) -> str:
    """The ``mindspore==X`` pin of pyproject.toml."""
    pin = next((d for d in deps(pyproject, []) if re.match(r"mindspore\s*==", d)), "")
    if not pin:
        raise SystemExit(f"{pyproject}: no mindspore==VERSION pin in [project] dependencies")
    return pin.split("==", 1)[1].strip()


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def release_url(version: str, arch: str, py: str) -> str:
    return RELEASE_URL.format(version=version, arch=arch, py=py)


def check_file(path: str, version: str, arch: str, py: str) -> str | None:
    """Why the wheel file ``path`` cannot be this image's MindSpore, or None when its name fits."""
    m = WHEEL_NAME.search(Path(path).name)
    if not m:
        return (f"MINDSPORE_WHEEL={path}: not a MindSpore wheel file name "
                f"(mindspore-{version}-{py}-{py}-linux_{arch}.whl)")
    wrong = [f"{what} {got} (the image needs {want})" for what, got, want in
             (("version", m["version"], version), ("Python", m["py"], py)) if got != want]
    if not m["platform"].endswith(arch) and m["platform"] != "any":
        wrong.append(f"machine {m['platform']} (the image needs linux_{arch})")
    return f"MINDSPORE_WHEEL={path}: {'; '.join(wrong)}" if wrong else None


def wheel_name(version: str, arch: str, py: str) -> str:
    return release_url(version, arch, py).rsplit("/", 1)[1]


def resolve(given: str, version: str, arch: str, py: str, find_links: str = "") -> str:
    """pip's argument for MindSpore: ``given`` when it fits; on aarch64 the wheel in ``find_links`` when there,
    else the release repository's; elsewhere "" (PyPI's pick, through the pin). Raises SystemExit naming the
    problem."""
    if given and "://" not in given:
        problem = check_file(given, version, arch, py)
        if problem:
            raise SystemExit(problem)
    if given or arch != "aarch64":
        return given
    local = Path(find_links) / wheel_name(version, arch, py) if find_links else None
    return str(local) if local is not None and local.is_file() else release_url(version, arch, py)


def what_to_supply(given: str, version: str, arch: str, py: str) -> str:
    """The message after pip failed to install MindSpore."""
    tried, name = given or release_url(version, arch, py), wheel_name(version, arch, py)
    return (f"pip could not install MindSpore {version} for this image (Python {py}, {arch}) from {tried}. "
            f"Supply the wheel {name} (from {release_url(version, arch, py)} or https://www.mindspore.cn/install) "
            f"as a file or a reachable URL: make image MINDSPORE_WHEEL=/path/to/{name} (buildah), "
            "or MINDSPORE_WHEEL=<URL> with docker")


def main(argv: list[str]) -> int:
    import argparse
    import os

    ap = argparse.ArgumentParser(prog="mindspore_wheel.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("pyproject", type=Path)
    ap.add_argument("given", nargs="?", default="", help="MINDSPORE_WHEEL: a URL or a wheel file, or empty")
    ap.add_argument("--failed", action="store_true", help="pip failed: say what to supply, exit 1")
    ap.add_argument("--python", default=python_tag(), help="the image's Python tag (default: this one's)")
    ap.add_argument("--arch", default=platform.machine(), help="the image's machine (default: this one)")
    a = ap.parse_args(argv)
    arch = {"arm64": "aarch64", "amd64": "x86_64"}.get(a.arch, a.arch)
    version, given = pinned_version(a.pyproject), a.given.strip()
    if a.failed:
        print(what_to_supply(given, version, arch, a.python), file=sys.stderr)
        return 1
    print(resolve(given, version, arch, a.python, os.environ.get("PIP_FIND_LINKS", "")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
