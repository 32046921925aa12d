"""Finding a run's checkpoints without MindSpore: where they live, which are published, healthy and intact,
which run wrote them (model and data identity), and moving them aside (train.resume=never).

finetune/io/checkpoint.py saves and loads them inside the ranks; the launcher's rerun check and prepare-data's
run check read them here before any rank starts.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobspec.fsutil import file_hash, remove_stale_temps
from jobspec.rundir import MANIFEST, RunDir, is_complete, step_dirs

STATE = "trainer_state.json"
CONDEMNED = "unhealthy.json"  # written into a checkpoint whose finite weights proved bad (condemn)


def run_identity(model_dir: str | Path, cache_dir: str | Path, model: str | None = None,
                 hashes: Path | None = None) -> dict[str, Any]:
    """The base model (:func:`model_hash`; ``model``: already computed, the plan's) and the token cache (its
    manifest) a run trains; stored in each checkpoint and compared on resume. The rank calls it once its token
    cache is ready (on a shared storage node 0 alone prepares it: the launchers cannot read it before msrun)."""
    try:
        manifest = json.loads((Path(cache_dir) / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = None
    return {"model": model or model_hash(model_dir, hashes), "data": data_id(manifest), "model_dir": str(model_dir)}


def model_hash(model_dir: str | Path, hashes: Path | None = None, log: Callable[[str], None] | None = None) -> str:
    """config.json and the sha256 of every weight file's whole content (an edit anywhere counts). ``hashes``:
    a JSON cache of file hashes keyed by (path, size, mtime_ns), so that a rerun reads no unchanged file again;
    ``log`` says when more than 1 GiB is read."""
    model_dir, h = Path(model_dir), hashlib.sha256()
    h.update(json.dumps(json.loads((model_dir / "config.json").read_text()), sort_keys=True).encode())
    try:
        known = json.loads(hashes.read_text()) if hashes else {}
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    keys = {f: _file_key(f) for f in sorted(model_dir.glob("*.safetensors"))}
    todo = [f for f, k in keys.items() if not isinstance(known.get(k), str)]
    size = sum(f.stat().st_size for f in todo)
    if log and size >= 1 << 30:
        log(f"hashing the {len(todo)} weight file(s) of {model_dir} ({size / (1 << 30):.1f} GiB) to identify the "
            f"run, once{f' (remembered in {hashes})' if hashes else ''}")
    digests = {k: known[k] for f, k in keys.items() if f not in todo}
    keep = dict(digests)
    for f in todo:
        digests[keys[f]] = file_hash(f)
        if _file_key(f) == keys[f]:  # not written while it was read
            keep[keys[f]] = digests[keys[f]]
    for f, k in keys.items():
        h.update(f"{f.name}:{digests[k]}".encode())
    if hashes and todo:
        _write_json(hashes, keep)
    return h.hexdigest()[:16]


def other_base(recorded: dict[str, Any], model_dir: str | Path, hashes: Path | None, what: str) -> str | None:
    """Why ``model_dir`` is not the base model ``recorded`` (a run identity's or an adapter's ``model`` hash and
    ``model_dir``) names, with the fix; None when it is, or when nothing was recorded (older versions).
    ``what``: the thing trained on that base, for the message."""
    if not recorded.get("model") or not (Path(model_dir) / "config.json").is_file():
        return None
    if model_hash(model_dir, hashes) == recorded["model"]:
        return None
    was = recorded.get("model_dir") or "another directory"
    return (f"{what} was trained on the base model {was} (identity {recorded['model']}), not on {model_dir} (other "
            f"weights or config.json); give the model it was trained on: --model-dir {was} (MODEL_DIR={was})")


def _file_key(f: Path) -> str:
    st = f.stat()
    return f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` atomically (readers and a racing writer see one whole file); a failure is harmless."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def data_id(m: dict[str, Any] | None) -> str:
    """A token cache manifest's settings, source contents and counts (not paths, mtimes or its build time)."""
    if m is None:
        return "none"
    sources = [(s.get("sha256") or s.get("size"), s.get("weight")) for s in m.get("sources", [])]
    key = [m.get("settings"), sources, m.get("num_samples"), m.get("num_tokens")]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def ways_out(output_dir: str | Path) -> str:
    """The two ways out of a refused resume, as one sentence."""
    return (f"Start a new run in another directory (OUTPUT_DIR={Path(output_dir)}-2), or set train.resume=never "
            f"to start over in {output_dir} (its checkpoints are moved to checkpoints.old-<time>, never mixed)")


def archive_checkpoints(output_dir: str | Path, log: Callable[[str], None] = print) -> Path | None:
    """train.resume=never: move the run's checkpoints aside (``checkpoints.old-<time>``) so that the new
    run never mixes with, prunes or resumes them; the new place, None when there were none."""
    root: Path = RunDir(output_dir).checkpoints
    if not root.is_dir() or not any(root.iterdir()):
        return None
    dest = root.with_name(f"checkpoints.old-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        root.rename(dest)
    except FileNotFoundError:  # another process of this node moved it first
        return None
    log(f"[checkpoint] train.resume=never: the earlier checkpoints moved to {dest} (delete it when no longer needed)")
    return dest


def tidy(run: RunDir, resume_never: bool, log: Callable[[str], None] = print) -> None:
    """A node's housekeeping before training: this host's dead processes' temporary directories removed
    (another host's are left to it), and with train.resume=never the old checkpoints moved aside (one rename:
    a node racing on shared storage finds nothing left to move). The launcher runs it on every node; a worker
    started without the launcher, on its rank 0."""
    remove_stale_temps(*run.temp_parents, log=log)
    if resume_never:
        archive_checkpoints(run.root, log)


def complete_steps(root: Path) -> list[Path]:
    """Published checkpoints (a manifest present), oldest first."""
    return [p for p in step_dirs(root) if is_complete(p)]


def condemn(path: Path, why: str) -> None:
    """Mark the published checkpoint at ``path`` unhealthy, saying ``why`` (finite weights that proved bad later:
    every later step non-finite, or not finite in the export dtype); resume and export then pass over it."""
    if is_complete(path):
        _write_json(path / CONDEMNED, {"why": why})


def unhealthy(path: Path) -> str | None:
    """Why the checkpoint at ``path`` must not be resumed or exported (written during a run of non-finite
    steps, or :func:`condemn`-ed), else None; an unreadable state is left to verification."""
    if (path / CONDEMNED).is_file():
        try:
            why = str(json.loads((path / CONDEMNED).read_text())["why"])
        except (OSError, ValueError, TypeError, KeyError):
            why = "marked so by its run"
        return f"{path}: unhealthy, {why}"
    try:
        streak = int(json.loads((path / STATE).read_text()).get("bad_streak", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return (f"{path}: unhealthy, written during {streak} consecutive steps with non-finite gradients "
            "(its weights may be blown up)") if streak else None


def usable(root: Path, log: Callable[[str], None] = print) -> list[Path]:
    """The published, healthy checkpoints under ``root``, newest first; a newer step directory passed
    over (no manifest.json, or unhealthy) is named with the reason."""
    out = []
    for p in reversed([p for p in step_dirs(root) if p.suffix != ".tmp"]):
        why = f"{p}: no {MANIFEST} (deleted, or its save never finished)" if not is_complete(p) else unhealthy(p)
        if why is None:
            out.append(p)
        elif not out:
            log(f"[checkpoint] skipping {why}; trying the previous checkpoint")
    return out


def verify(path: Path, names: list[str] | None = None, hashes: bool = True) -> str | None:
    """None when ``names`` (default: every file in the manifest) match the manifest, else the problem
    naming the file. ``hashes=False`` checks presence and sizes only."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path / MANIFEST}: unreadable ({type(e).__name__}: {e})"
    entries = {n: None for n in files} if isinstance(files, list) else files  # a list: older manifests, names only
    for name in names if names is not None else list(entries):
        f = path / name
        if name not in entries:
            return f"{f}: not listed in the manifest"
        if not f.is_file():
            return f"{f}: missing"
        want = entries[name]
        if want is None:
            continue
        if f.stat().st_size != want["size"]:
            return f"{f}: {f.stat().st_size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if hashes and file_hash(f) != want["sha256"]:
            return f"{f}: contents differ from the manifest's sha256 (corrupted)"
    return None


def find_latest(root: Path) -> Path | None:
    """Newest published checkpoint (one with a manifest), or None; not yet verified."""
    done = complete_steps(root)
    return done[-1] if done else None
