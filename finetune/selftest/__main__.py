"""``python -m finetune.selftest OUT_DIR [--device cpu|npu] [--quick] [--no-collectives]``: the self-test
(``python -m launcher selftest`` runs it). Versions first, then one row per check, then
``OUT_DIR/selftest.json``; exit status 1 when a row failed, 2 when ``--device npu`` finds no NPU.

On Ascend every visible NPU (``--quick``: the first) runs the op checks in a process of its own, all at
once; then msrun runs the collective checks across the node's NPUs. On CPU one process runs the same
checks against the contract twins (``finetune.selftest.twins``) at scaled-down shapes, and the
collectives under msrun with two CPU workers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from finetune.selftest import collectives, versions
from jobspec.platform import PLATFORMS, by_target, visible_npus

# the whole run on 8 NPUs, by design: the per-check budgets (runner, collectives) add up below it
TOTAL_BUDGET_S = 120.0


def device_rows(device: str, device_id: int | None, install_twins: bool) -> list[dict]:
    """This process's op rows on ``device`` (Ascend: NPU ``device_id``)."""
    from finetune.dist import set_device
    from finetune.selftest import runner

    set_device(device, device_id)
    if install_twins:
        from finetune.selftest.twins import install_fused

        install_fused()
    return runner.as_dicts(runner.run_device_checks(device, runner.compute_dtype(device)))


def npu_ids(quick: bool, dev: Path = Path("/dev"), env: Mapping[str, str] = os.environ) -> list[int]:
    """The logical ids 0..n-1 the runtime gives the visible NPUs (what ``set_device`` takes; n:
    ``jobspec.platform.visible_npus``). A container given davinci4-7 sees them as 0-3; the physical numbers are
    never device ids."""
    n = visible_npus(dev, env)
    return list(range(n))[:1] if quick else list(range(n))


NO_NPU = ("selftest --device npu: no NPU visible (no /dev/davinciN in this container); add the --device=/dev/davinciN "
          "flags (docs/running.md), or run --device cpu to check the CPU path")


def _spawn_devices(out: Path, ids: list[int]) -> list[dict]:
    """One process per NPU, all at once; rows named ``npu<i>/<check>``."""
    procs = []
    for i in ids:
        path = out / f"selftest.npu{i}.json"
        procs.append((i, path, subprocess.Popen([sys.executable, "-m", "finetune.selftest", str(out), "--device",
                                                 "npu", "--one-device", str(i)])))
    rows = []
    for i, path, proc in procs:
        rc = proc.wait()
        if rc != 0 or not path.is_file():
            rows.append(_missing(f"npu{i}", f"the check process exited with {rc}"))
            continue
        rows += [{**r, "name": f"npu{i}/{r['name']}"} for r in json.loads(path.read_text())]
    return rows


def _missing(name: str, why: str) -> dict:
    return {"name": name, "shape": "-", "dtype": "-", "max_rel_err": None, "tolerance": 0.0, "ok": False,
            "seconds": 0.0, "budget_s": 0.0, "contract": "the device runs the self-test", "fix":
            "see the process's output above; check the NPU with npu-smi and the driver mounts", "error": why}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_rows(out: Path, device: str, nproc: int, port: int | None = None) -> list[dict]:
    """The collective checks under msrun, ``nproc`` workers on this node; one row per collective (worst rank)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    msrun = shutil.which("msrun", path=env["PATH"]) or "msrun"
    argv = [msrun, f"--worker_num={nproc}", f"--local_worker_num={nproc}", f"--master_port={port or _free_port()}",
            "--join=True",
            f"--log_dir={out / 'selftest_msrun'}", collectives.__file__, str(out), device]
    for f in out.glob("collectives.rank*.json"):
        f.unlink()
    rc = subprocess.call(argv, env=env, cwd=out, stdout=subprocess.DEVNULL)
    files = sorted(out.glob("collectives.rank*.json"))
    if rc != 0 or len(files) != nproc:
        return [_missing("collectives", f"msrun exited with {rc}; {len(files)} of {nproc} ranks reported "
                                        f"(logs in {out / 'selftest_msrun'})")]
    per_rank = [json.loads(f.read_text()) for f in files]
    rows = []
    for same in zip(*per_rank):
        errs = [r["err"] for r in same]
        err = None if None in errs else max(errs)
        seconds = max(r["seconds"] for r in same)
        ok = err is not None and err <= collectives.TOLERANCE
        rows.append({"name": same[0]["name"], "shape": same[0]["shape"], "dtype": "float32", "max_rel_err": err,
                     "tolerance": collectives.TOLERANCE, "ok": ok, "seconds": round(seconds, 3),
                     "budget_s": collectives.BUDGET_S, "contract": "finetune.dist collectives equal the sum of "
                     "every rank's data (hooks return the gradient; the async buffer lives until wait)",
                     "fix": "" if ok else "check HCCL (HCCL_* settings, the network between NPUs) and the "
                     "driver/CANN versions", "error": "; ".join(sorted({r["error"] for r in same if r["error"]}))})
    return rows


def table(vers: dict, rows: list[dict]) -> str:
    lines = [f"[selftest] {ln}" for ln in versions.lines(vers)]
    lines.append(f"{'check':<36} {'shape':<44} {'dtype':<9} {'max rel err':>11} {'tol':>8} {'':>4} {'time s':>7}")
    for r in rows:
        err = "-" if r["max_rel_err"] is None else f"{r['max_rel_err']:.2e}"
        lines.append(f"{r['name']:<36} {r['shape'][:44]:<44} {r['dtype']:<9} {err:>11} {r['tolerance']:>8.0e} "
                     f"{'ok' if r['ok'] else 'FAIL':>4} {r['seconds']:>7.2f}")
        if not r["ok"]:
            lines.append(f"    contract: {r['contract']}" + (f"; {r['error']}" if r["error"] else ""))
            lines.append(f"    fix: {r['fix']}")
    failed = [r["name"] for r in rows if not r["ok"]]
    lines.append(f"[selftest] {len(rows) - len(failed)}/{len(rows)} checks ok" +
                 (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return "\n".join(lines)


def run(out: Path, device: str, quick: bool, with_collectives: bool, install_twins: bool = True) -> int:
    """The whole self-test; prints the table and writes ``out/selftest.json``. 0 when every row is ok."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    npu = by_target(device).accelerator
    ids = npu_ids(quick) if npu else []
    if npu and not ids:
        print(f"[selftest] {NO_NPU}", flush=True)
        return 2
    vers = versions.probe(npu=npu)
    if npu:
        rows = _spawn_devices(out, ids)
        nproc = len(npu_ids(False))
    else:
        rows, nproc = device_rows("CPU", None, install_twins), 2
    if with_collectives and nproc > 1:
        rows += collective_rows(out, device, nproc)
    took = time.perf_counter() - t0
    print(table(vers, rows), flush=True)
    slow = [r["name"] for r in rows if r["seconds"] > r["budget_s"] > 0]
    print(f"[selftest] took {took:.0f} s (designed for under {TOTAL_BUDGET_S:.0f} s on 8 NPUs)"
          + (f"; over their budget: {', '.join(slow)}" if slow else ""), flush=True)
    (out / "selftest.json").write_text(json.dumps({"versions": vers, "rows": rows, "seconds": round(took, 1)},
                                                  indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m finetune.selftest", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="OUTPUT_DIR: selftest.json goes here")
    ap.add_argument("--device", choices=("cpu", "npu"), default="npu" if npu_ids(False) else "cpu")
    ap.add_argument("--quick", action="store_true", help="one NPU per node runs the op checks")
    ap.add_argument("--no-collectives", action="store_true", help="skip the msrun collective checks")
    ap.add_argument("--one-device", type=int, default=None, help=argparse.SUPPRESS)  # a child of the NPU run
    a = ap.parse_args(argv)
    device = PLATFORMS[a.device].target
    if a.one_device is not None:
        rows = device_rows(device, a.one_device, install_twins=False)
        (a.out / f"selftest.npu{a.one_device}.json").write_text(json.dumps(rows))
        return 0
    return run(a.out, device, a.quick, not a.no_collectives)


if __name__ == "__main__":
    sys.exit(main())
