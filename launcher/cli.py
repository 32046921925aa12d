"""The launcher's command line: one subparser per command, settings (``key=value``, ``VAR=value``)
anywhere after it; a command that wraps a tool (render, generate, export) passes the tool its options.

``commands`` maps a name to ``(handler, one-line help, passes its own options through)``.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping

from jobspec.config import Recipe
from launcher import settings

PROG = "ascend-finetune"  # pyproject.toml [project.scripts]; `python -m launcher` is the same


def _env_help() -> str:
    rows = [f"  {var:<24} {key or '-':<22} {meaning.replace('`', '').replace(chr(92), '')}"
            for var, key, meaning in settings.ENV_CONTRACT]
    return "environment (variable, recipe key, meaning):\n" + "\n".join(rows)


def build_parser(commands: Mapping[str, tuple], description: str) -> argparse.ArgumentParser:
    """One subparser per command, each with its own --help; commands that wrap a tool pass its options on."""
    ap = argparse.ArgumentParser(prog=PROG, description=description,
                                 epilog=_env_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="{" + ",".join(commands) + "}")
    for name, (_, text, passthrough) in commands.items():
        sp = sub.add_parser(name, help=text, description=text, add_help=not passthrough,
                            epilog=_env_help() if not passthrough else None,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("--recipe", default=None, help="recipe name in recipes/ or a YAML path (env RECIPE)")
        if not passthrough:
            sp.add_argument("overrides", nargs="*", metavar="key=value",
                            help="recipe overrides (train.lr=1e-5) or variables (TP=2); beat the environment")
    sub.choices["plan"].add_argument("--json", action="store_true", help="print the plan JSON alone (for jq)")
    for name in ("preflight", "train"):
        sub.choices[name].add_argument("--skip-selftest", action="store_true",
                                       help="on an NPU host, do not run the self-test after the preflight checks")
    return ap


def _is_setting(item: str) -> bool:
    """``train.lr=1e-5`` / ``TP=2`` / ``RECIPE=x``: a recipe key or a contract variable followed by '='."""
    key = item.split("=", 1)[0]
    return "=" in item and (key.split(".")[0] in Recipe.__dataclass_fields__ or key in settings.ENV_KEYS
                            or key == "RECIPE")


def parse(ap: argparse.ArgumentParser, argv: list[str], commands: Mapping[str, tuple]) -> argparse.Namespace:
    """Commands of our own take settings anywhere; a wrapping command's other items go to its tool."""
    args, rest = ap.parse_known_args(argv)
    if commands[args.command][2]:
        args.overrides = [a for a in rest if _is_setting(a)]
        args.rest = [a for a in rest if not _is_setting(a)]
    else:
        args.overrides += [a for a in rest if _is_setting(a)]
        unknown = [a for a in rest if not _is_setting(a)]
        if unknown:
            ap.parse_args([args.command, *unknown])  # exits 2 naming them, with the command's usage
    return args
