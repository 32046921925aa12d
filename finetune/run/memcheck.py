"""The step-1 memory record: the measured peak beside the plan's estimate, into metrics.jsonl and summary.json.

The estimate is plan.json's ``memory`` (the launcher's, ``jobspec/memory.py``); a recipe run without a plan (a
test's) estimates it here. The measurement is MindSpore's device statistics (``mindspore.runtime``'s peak
allocated and reserved bytes) where they are non-zero (Ascend); on CPU, where MindSpore 2.10 reports 0, the
process's peak RSS instead (framework included, so no warning there: tools/bench_memory.py subtracts an empty
process's). A device peak above the estimate by more than :data:`ABOVE` prints a warning naming the largest
term and the setting that shrinks it. A device allocation that fails (MindSpore's out-of-memory errors) ends the rank
with :class:`DeviceOutOfMemory`: where it ran out, the plan's estimate and its largest term with that setting.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from finetune.run.perf import peak_rss_bytes
from jobspec.lifecycle import DeviceOutOfMemory
from jobspec.memory import MemoryEstimate, memory_estimate
from jobspec.memory_terms import SHRINKS

ABOVE = 0.05  # warn when the device peak exceeds the estimate by more than this
# MindSpore 2.10's failed device allocations (strings of its libraries: the PyNative op runner's "Allocate memory
# failed", measured on CPU; the Ascend memory manager's "Out of Memory!!! Request memory size"; the memory pool's
# "Memory not enough"; the kernel launch's "memory isn't enough"), not a host pin-memory failure
OUT_OF_MEMORY = re.compile(r"Out of Memory!!!|memory isn't enough|Memory not enough|The device memory is not enough|"
                           r"(?<!pin_memory )Allocate (?:device |output |workspace |dynamic workspace )?memory failed|"
                           r"Malloc device memory failed", re.IGNORECASE)


def planned(plan: Path) -> MemoryEstimate | None:
    """plan.json's estimate; None where there is no plan or it has none."""
    try:
        mem = json.loads(plan.read_text()).get("memory", {})
    except (OSError, ValueError, AttributeError):
        return None
    return MemoryEstimate.from_parts(mem) if "total" in mem else None


def plan_estimate(plan: Path, recipe, model_config: dict[str, Any]) -> MemoryEstimate:
    """plan.json's estimate, or the recipe's own where there is no plan (or it has none)."""
    return planned(plan) or memory_estimate(recipe, model_config)


def largest_term(est: MemoryEstimate) -> str:
    """The estimate's largest term, its size and the setting that shrinks it."""
    big = est.largest()
    return f"the largest term is {big} ({getattr(est, big) / 2**30:.2f} GiB), shrunk by {SHRINKS[big]}"


def measured() -> dict[str, int | str]:
    """The peak of this process: device statistics (``memory_peak_allocated_bytes``, ``memory_peak_reserved_bytes``)
    where MindSpore reports them, else ``memory_peak_rss_bytes``; ``memory_source`` says which."""
    import mindspore as ms

    allocated, reserved = int(ms.runtime.max_memory_allocated()), int(ms.runtime.max_memory_reserved())
    if reserved > 0:
        return {"memory_source": "device", "memory_peak_allocated_bytes": allocated,
                "memory_peak_reserved_bytes": reserved}
    return {"memory_source": "rss", "memory_peak_rss_bytes": peak_rss_bytes()}


def memory_record(est: MemoryEstimate, peak: dict[str, int | str]) -> tuple[dict, str]:
    """(the step-1 record's memory fields, the line to log): the estimate's total and terms beside ``peak``."""
    fields = {**peak, "memory_estimate_bytes": est.total,
              "memory_estimate_terms": {k: v for k, v in est.parts().items() if v}}
    if peak["memory_source"] != "device":
        rss = int(peak["memory_peak_rss_bytes"])
        return fields, (f"[train] peak RSS {rss / 2**30:.2f} GiB at step 1 vs the estimate {est.total / 2**30:.2f} GiB "
                        "(CPU: MindSpore reports no device statistics; the RSS includes the framework)")
    reserved = int(peak["memory_peak_reserved_bytes"])
    off = reserved / est.total - 1
    line = (f"peak device memory at step 1: {reserved / 2**30:.2f} GiB reserved, "
            f"{int(peak['memory_peak_allocated_bytes']) / 2**30:.2f} GiB allocated, vs the estimate "
            f"{est.total / 2**30:.2f} GiB ({off:+.0%})")
    if off <= ABOVE:
        return fields, f"[train] {line}"
    return fields, (f"[train] warning: {line}: more than {ABOVE:.0%} above; {largest_term(est)}; report it with the "
                    "recipe so the estimate can be fixed")


def out_of_memory(exc: BaseException, plan: Path, where: str) -> DeviceOutOfMemory | None:
    """``exc`` named as :class:`DeviceOutOfMemory` when it is MindSpore's failed device allocation (else None):
    ``where`` it ran out, plan.json's estimate with its largest term and the setting that shrinks it, the device's
    peak allocated so far (where MindSpore reports one) and MindSpore's own first line."""
    text = str(exc)
    if not OUT_OF_MEMORY.search(text):
        return None
    first = next((line.strip() for line in text.splitlines() if OUT_OF_MEMORY.search(line)), "")
    est = planned(plan)
    parts = [f"device memory ran out {where}",
             f"the plan estimated {est.total / 2**30:.2f} GiB per device; {largest_term(est)}" if est else
             f"no estimate in {plan} (python -m launcher plan prints one, term by term)"]
    import mindspore as ms

    peak = int(ms.runtime.max_memory_allocated())
    if peak:
        parts.append(f"peak allocated before it {peak / 2**30:.2f} GiB")
    return DeviceOutOfMemory("; ".join([*parts, f"MindSpore: {first[:200]}"]))


@contextmanager
def naming_out_of_memory(plan: Path, where: Callable[[], str]) -> Iterator[None]:
    """Re-raise MindSpore's failed device allocation inside the block as :func:`out_of_memory`'s
    :class:`DeviceOutOfMemory` (the original chained, in the rank's traceback file); other errors unchanged."""
    try:
        yield
    except RuntimeError as e:
        named = out_of_memory(e, plan, where())
        if named is None:
            raise
        raise named from e
