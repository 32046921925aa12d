"""``npu-smi`` runner and the ``npu-smi info`` parsers: the device table and the process table.

``npu-smi info`` prints two tables. The device table has two rows per chip (NPU id + name + health +
power/temp, then chip + bus id + AICore % + memory/HBM); the process table after it has one row per
process holding an NPU (NPU id + chip, pid, name, MB, and from 26.x a "Process id in container" column).
Both tables start their rows with numbers, so they are split at the process table's header first.
Recorded outputs of several driver versions are in ``tests/launcher/fixtures/npu-smi``.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

NpuSmi = Callable[[list[str]], "str | None"]
_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")


def dcmi_error(text: str) -> int | None:
    """The code of ``dcmi module initialize failed. ret is -8005`` (and the like) in npu-smi's output."""
    m = re.search(r"dcmi .*ret is (-\d+)", text)
    return int(m.group(1)) if m else None


def driver_version(text: str) -> str | None:
    """The driver version in ``npu-smi info``'s header (``| npu-smi 25.2.0   Version: 25.2.0 |``), or None."""
    m = re.search(r"Version:\s*(\d+\.\d+\.\w+)", text)
    return m.group(1) if m else None


def run_npu_smi(args: list[str], timeout_s: float = 15.0) -> str | None:
    """``npu-smi <args>`` output, or None when npu-smi is absent or fails (its output when a dcmi error
    code says why: :func:`dcmi_error`)."""
    exe = shutil.which("npu-smi")
    if not exe:
        return None
    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode == 0:
        return r.stdout
    return r.stdout + r.stderr if dcmi_error(r.stdout + r.stderr) is not None else None


@dataclass(frozen=True)
class NpuRow:
    """One NPU of the device table (the first chip's rows when an NPU has several chips)."""

    npu: int
    name: str
    health: str
    bus_id: str
    power_w: float | None = None
    temp_c: float | None = None
    aicore_pct: float | None = None
    hbm_used_mb: int | None = None
    hbm_total_mb: int | None = None


@dataclass(frozen=True)
class NpuProcess:
    """One row of the process table."""

    npu: int
    pid: int
    name: str
    memory_mb: int
    pid_in_container: int | None = None  # 26.x column; None when absent or "NA" (not in this container)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _rows(lines: list[str]) -> list[list[str]]:
    return [_cells(ln) for ln in lines if ln.startswith("|") and "No running processes" not in ln]


def _split(text: str) -> tuple[list[str], list[str]]:
    """(device table lines, process table lines after its header)."""
    lines = text.splitlines()
    head = next((i for i, ln in enumerate(lines) if "Process id" in ln and "Process name" in ln), len(lines))
    return lines[:head], lines[head + 1:]


def _num(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "-" or "NA"


def parse_info(text: str) -> dict[int, NpuRow]:
    """``npu-smi info`` device table -> {NPU id: NpuRow}; process rows are never read as NPUs."""
    out: dict[int, NpuRow] = {}
    rows = _rows(_split(text)[0])
    for first, second in zip(rows, rows[1:]):
        m = re.fullmatch(r"(\d+)\s+(\S+)", first[0]) if len(first) >= 3 else None
        if not m or len(second) < 3 or not re.fullmatch(r"[0-9A-Fa-f]{4}:[0-9A-Fa-f:.]+", second[1]):
            continue
        stats, usage = first[2].split(), second[2].split()
        hbm = _PAIR.findall(second[2])
        out.setdefault(int(m.group(1)), NpuRow(
            npu=int(m.group(1)), name=m.group(2), health=first[1], bus_id=second[1],
            power_w=_num(stats[0]) if stats else None, temp_c=_num(stats[1]) if len(stats) > 1 else None,
            aicore_pct=_num(usage[0]) if usage else None,
            hbm_used_mb=int(hbm[-1][0]) if hbm else None, hbm_total_mb=int(hbm[-1][1]) if hbm else None))
    return out


def parse_processes(text: str) -> list[NpuProcess]:
    """``npu-smi info`` process table -> one NpuProcess per row (with or without the container column)."""
    out = []
    for row in _rows(_split(text)[1]):
        m = re.fullmatch(r"(\d+)(?:\s+\d+)?", row[0])
        if not m or len(row) < 4 or not row[1].isdigit():
            continue
        mem = row[3].split()[0] if row[3] else ""
        inner = row[4] if len(row) > 4 else ""
        out.append(NpuProcess(npu=int(m.group(1)), pid=int(row[1]), name=row[2],
                              memory_mb=int(mem) if mem.isdigit() else 0,
                              pid_in_container=int(inner) if inner.isdigit() else None))
    return out
