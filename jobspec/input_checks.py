"""Recipe checks of what a user points the job at: data sources (columns, validation split, URLs) and
``lora.*`` settings that the chosen method would ignore. Called by ``jobspec.validate.validate``."""
from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Protocol

from jobspec.lora_config import LoraConfig
from jobspec.recipe_parse import Problem


class DataSources(Protocol):
    """The fields of the data section read here (jobspec.config.DataConfig; config imports this module)."""

    paths: list[str]
    val_paths: list[str]
    columns: dict[str, Any]
    val_size: float

# data.columns keys: the fields the data formats read (message fields: role, content)
DATA_COLUMNS = ("instruction", "input", "output", "system", "history", "conversations", "messages", "tools",
                "text", "role", "content")
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)")
_HUB = re.compile(r"(?:hf://(?:datasets/)?|https?://huggingface\.co/datasets/)([^/@]+/[^/@]+|[^/@]+)")


def input_problems(data: DataSources, method: str, lora: LoraConfig) -> list[Problem]:
    """Every problem of the data sources, and of the lora section against train.method."""
    return (_data_source_problems(data) + url_problems("data.paths", data.paths)
            + url_problems("data.val_paths", data.val_paths) + unused_lora_problems(method, lora))


def download_command(url: str) -> tuple[str, str]:
    """(the command that fetches ``url`` onto local storage, the local path it writes) for a data URL."""
    hub = _HUB.match(url)
    if hub:
        name = hub.group(1)
        local = f"/data/{name.rsplit('/', 1)[-1]}"
        return f"huggingface-cli download --repo-type dataset {name} --local-dir {local}", local
    scheme, rest = _URL.match(url).groups()  # type: ignore[union-attr]  # only URLs reach here
    local = f"/data/{rest.rstrip('/').rsplit('/', 1)[-1] or 'data'}"
    tool = {"s3": f"aws s3 cp {url} {local}", "gs": f"gsutil cp {url} {local}"}
    return tool.get(scheme.lower(), f"curl -L -o {local} {url}"), local


def url_problems(key: str, paths: list[str]) -> list[Problem]:
    """A URL among the data paths: the data is read from local files on every node (no internet there)."""
    out = []
    for p in paths:
        if _URL.match(p):
            command, local = download_command(p)
            out.append(Problem(key, f"{p} is a URL; the data is read from local files on every node, which have no "
                                    f"internet access: download it first ({command}) onto storage every node "
                                    "mounts, then give its local path", local, repr(",".join(paths))))
    return out


def unused_lora_problems(method: str, lora: LoraConfig) -> list[Problem]:
    """``lora.*`` settings with train.method=full would be silently unused: refused, naming them."""
    if method == "lora":
        return []
    default = LoraConfig()
    changed = [(f.name, getattr(lora, f.name)) for f in dataclasses.fields(lora)
               if getattr(lora, f.name) != getattr(default, f.name)]
    if not changed:
        return []
    # under train.method's key: an invalid method (already reported) reports no more
    return [Problem("train.method", f"{', '.join(f'lora.{k}={v!r}' for k, v in changed)} set, but full fine-tuning "
                    "trains every weight and ignores the lora section; set train.method=lora, or drop the lora.* "
                    "settings", value=repr(method))]


def _data_source_problems(d: DataSources) -> list[Problem]:
    """data.columns, data.val_size / data.val_paths."""
    p: list[Problem] = []
    for k, v in d.columns.items():
        if k not in DATA_COLUMNS:
            close = difflib.get_close_matches(str(k), DATA_COLUMNS, n=1)
            p.append(Problem("data.columns", f"unknown field {k!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else "")
                             + f"; keys are the formats' fields ({', '.join(DATA_COLUMNS)}), values your dataset's",
                             """'{"instruction": "question", "output": "answer"}'"""))
        elif not isinstance(v, str) or not v:
            p.append(Problem(f"data.columns.{k}", "the name of a field of your records",
                             f"""'{{"{k}": "my_{k}"}}'""", repr(v)))
    if d.val_size < 0 or (d.val_size >= 1 and d.val_size != int(d.val_size)):
        p.append(Problem("data.val_size", "a fraction below 1 (0.05: 5% of the samples) or a whole count "
                                          "(200 samples) held out for validation; 0: none", "0.05", repr(d.val_size)))
    if d.val_size and d.val_paths:
        p.append(Problem("data.val_size", "data.val_size and data.val_paths both set: validate on held-out samples "
                                          "(data.val_size) or on your own files (data.val_paths), not both", "0"))
    return p
