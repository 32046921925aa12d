"""Which MindSpore wheel pip installs in the image, for the image's own Python and machine.

    python tools/image/mindspore_wheel.py PYPROJECT [MINDSPORE_WHEEL]            # print pip's argument
    python tools/image/mindspore_wheel.py PYPROJECT [MINDSPORE_WHEEL] --failed   # say what to supply; exit 1

PyPI's mindspore 2.10.0 is tagged py3-none-any but holds x86-64 libraries, so on x86_64 pip's own pick is
right (empty output) and on aarch64 (Atlas 800T A2) the wheel comes from MindSpore's release repository,
whose URL pattern (as MindSpore's install page and Ascend's ascend-deployer list it for each release) is
:data:`RELEASE_URL`. ``MINDSPORE_WHEEL`` (a URL or a file) overrides it; a file whose name says another
version, Python or machine is refused before pip runs. Run by the Dockerfile with the image's Python.
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


def resolve(given: str, version: str, arch: str, py: str) -> str:
    """pip's argument for MindSpore: ``given`` when it fits, the release repository's wheel on aarch64, else ""
    (PyPI's pick, through the pin). Raises SystemExit naming the problem."""
    if given and "://" not in given:
        problem = check_file(given, version, arch, py)
        if problem:
            raise SystemExit(problem)
    if given:
        return given
    return release_url(version, arch, py) if arch == "aarch64" else ""


def what_to_supply(given: str, version: str, arch: str, py: str) -> str:
    """The message after pip failed to install MindSpore."""
    tried = given or release_url(version, arch, py)
    return (f"pip could not install MindSpore {version} for this image (Python {py}, {arch}) from {tried}. "
            f"Supply the wheel mindspore-{version}-{py}-{py}-linux_{arch}.whl (from "
            f"{release_url(version, arch, py)} or https://www.mindspore.cn/install) as a file or a reachable URL: "
            f"make image MINDSPORE_WHEEL=/path/to/mindspore-{version}-{py}-{py}-linux_{arch}.whl (buildah), "
            "or MINDSPORE_WHEEL=<URL> with docker")


def main(argv: list[str]) -> int:
    failed = "--failed" in argv
    args = [a for a in argv if a != "--failed"]
    pyproject, given = Path(args[0]), (args[1] if len(args) > 1 else "").strip()
    version, arch, py = pinned_version(pyproject), platform.machine(), python_tag()
    arch = {"arm64": "aarch64", "amd64": "x86_64"}.get(arch, arch)
    if failed:
        print(what_to_supply(given, version, arch, py), file=sys.stderr)
        return 1
    print(resolve(given, version, arch, py))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
