"""Resumable training checkpoints: written atomically, verified before they are loaded.

Layout: ``<output_dir>/checkpoints/step_00000030/`` holding, per rank that owns something,
``model_rank00000.safetensors`` (this rank's parameters, fp32) and ``optim_rank00000.safetensors``
(its optimizer state), plus ``trainer_state.json`` (step, data position, loss scale, RNG seed,
the model and data identity) and, written last, ``manifest.json`` listing every file with its size
and sha256 (each rank hashes its own files). Everything goes to ``step_N.tmp`` first and is
renamed once every rank has finished, so a crash never leaves a checkpoint that looks complete.
Before a save, every rank checks that the file system has room for the whole checkpoint.
On resume the newest checkpoint whose files verify and load on every rank is used; one that fails
is skipped with the file and the reason. Pruning never deletes the newest verified checkpoint.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from finetune.dist import RankInfo, all_reduce_sum, barrier
from jobspec.checkpoint_index import (
    STATE,
    complete_steps,
    unhealthy,
    usable,
    verify,
    ways_out,
)
from jobspec.fsutil import file_hash, publish
from jobspec.memory import BUCKET_BYTES
from jobspec.rundir import MANIFEST, step_dirs, step_name

SPACE_MARGIN = 16 * 2**20  # bytes kept free beyond the checkpoint itself


class CheckpointMismatch(ValueError):
    """The checkpoint belongs to another run (layout, model or data): refused, never skipped."""


class InsufficientSpace(RuntimeError):
    """Not enough free disk space for the next checkpoint; nothing was written."""


@dataclass
class TrainerState:
    """What besides tensors a resumed run needs to continue exactly."""

    step: int
    loader: dict
    scaler: dict
    seed: int
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    identity: dict = field(default_factory=dict)  # {"model": ..., "data": ...}: see run_identity
    best_eval: float | None = None  # train.early_stop_patience: the best eval loss so far (None: no eval yet)
    evals_without_gain: int = 0  # and the evaluations since it
    skipped_steps: int = 0  # steps skipped for non-finite gradients so far (this run and those it resumed)
    bad_streak: int = 0  # consecutive non-finite steps at the save: > 0 marks the checkpoint unhealthy
    settings: dict = field(default_factory=dict)  # what was trained and for how long (jobspec/rerun.py)
    finished: bool = False  # the run's final checkpoint (export and check followed)


def layout(rank: RankInfo) -> dict:
    return {"world_size": rank.world_size, "tp": rank.tp, "dp": rank.dp}


# ------------------------------------------------------------------------------------------ identity


def _check_identity(path: Path, saved: dict, current: dict | None) -> None:
    if not current or not saved:
        return
    differ = [k for k in ("model", "data", "method") if saved.get(k) != current.get(k)]
    what = {"model": ("base model", f"{saved.get('model_dir')}", f"{current.get('model_dir')}"),
            "data": ("token cache", "its data", "this run's data"),
            "method": ("train.method and LoRA adapters", "absent: full fine-tuning", "absent: full fine-tuning")}
    if differ:
        raise CheckpointMismatch(
            f"{path} was written by another run: its " + " and ".join(
                f"{what[k][0]} is {saved.get(k)} ({what[k][1]}) but this run's is {current.get(k)} ({what[k][2]}"
                + (", same directory, other contents" if k == "model" and what[k][1] == what[k][2] else "") + ")"
                for k in differ) +
            f". {ways_out(path.parent.parent)}")


# ---------------------------------------------------------------------------------------------- save

def _entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": file_hash(path)}


def _world_sum(values: list[float], rank: RankInfo) -> list[float]:
    """Element-wise sum over every rank (identity in a single process)."""
    if rank.world_size == 1:
        return values
    import mindspore as ms

    return all_reduce_sum(ms.Tensor(np.array(values, np.float32)), rank.world_group).asnumpy().tolist()


def _nbytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values()) + 1024 + 200 * len(arrays)  # + safetensors header


def _free_bytes(root: Path) -> int:
    probe = root
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


WRITE_ERRORS = (OSError, SafetensorError)  # safetensors reports ENOSPC as its own error, not an OSError


def save_checkpoint(root: Path, state: TrainerState, model_params: list, optim_state: dict[str, np.ndarray],
                    rank: RankInfo, keep: int, owns_model: bool = True, owns_optim: bool = True) -> Path:
    """Write this rank's share; rank 0 writes the manifest, publishes the directory and prunes.

    ``owns_model`` / ``owns_optim``: whether this rank's copy must be stored (replicas across
    data-parallel ranks are stored once). Collective: every rank must call it at the same step.
    Raises :class:`InsufficientSpace` (on every rank, nothing written) when the disk is too full.
    """
    final = root / step_name(state.step)
    tmp = final.with_name(final.name + ".tmp")
    r = f"rank{rank.rank:05d}"
    shares = {}
    if owns_model:
        shares[f"model_{r}.safetensors"] = {p.name: p.asnumpy().astype(np.float32) for p in model_params}
    if owns_optim:
        shares[f"optim_{r}.safetensors"] = {k: np.ascontiguousarray(v) for k, v in optim_state.items()}
    need = _world_sum([float(sum(_nbytes(a) for a in shares.values()))], rank)[0] + SPACE_MARGIN
    free = _free_bytes(root)
    if _world_sum([1.0 if free < need else 0.0], rank)[0]:
        raise InsufficientSpace(
            f"not enough disk space for the checkpoint of step {state.step}: it needs {need / 2**20:.0f} MiB, "
            f"{free / 2**20:.0f} MiB are free under {root}; free space there (or lower train.keep_checkpoints), "
            f"then rerun to resume from the newest checkpoint (older checkpoints are untouched)")
    if rank.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(rank)
    error = None
    try:
        tmp.mkdir(parents=True, exist_ok=True)  # other nodes without shared storage
        entries = {}
        for name, arrays in shares.items():
            save_file(arrays, str(tmp / name))
            entries[name] = _entry(tmp / name)
        (tmp / f".files_{r}.json").write_text(json.dumps(entries))
    except WRITE_ERRORS as e:  # e.g. ENOSPC although the estimate fitted: no rank publishes
        error = e
    if _world_sum([1.0 if error else 0.0], rank)[0]:
        raise _unpublished(tmp, state.step, error, rank)
    if rank.is_main:
        try:
            _write_manifest(tmp, state, rank)
            publish(tmp, final, owned=True)  # a step directory under checkpoints/ is this project's
        except WRITE_ERRORS as e:  # the other ranks stop with this rank (msrun ends the job)
            raise _unpublished(tmp, state.step, e, rank) from e
        _prune(root, keep)
    barrier(rank)
    if rank.local_rank == 0 and tmp.exists() and not final.exists():  # node-local storage
        tmp.rename(final)
    return final


def _unpublished(tmp: Path, step: int, error: BaseException | None, rank: RankInfo) -> InsufficientSpace:
    """A write of the checkpoint at ``tmp`` failed: its temporary directory removed (rank 0), the error to raise."""
    if rank.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    return InsufficientSpace(f"writing the checkpoint of step {step} under {tmp.parent} failed "
                             f"({error or 'on another rank'}); nothing was published, older checkpoints "
                             "are untouched")


def _write_manifest(tmp: Path, state: TrainerState, rank: RankInfo) -> None:
    """trainer_state.json, then the manifest of every file (the ranks' hashes merged), written last."""
    (tmp / STATE).write_text(json.dumps(state.__dict__, indent=1))
    files = {STATE: _entry(tmp / STATE)}
    for part in sorted(tmp.glob(".files_rank*.json")):
        files.update(json.loads(part.read_text()))
        part.unlink()
    (tmp / MANIFEST).write_text(json.dumps({"step": state.step, "layout": layout(rank), "files": files}, indent=1))


def _prune(root: Path, keep: int) -> None:
    """Keep the ``keep`` newest checkpoints whose files match their manifest's sizes (never fewer than
    one) and always the newest healthy one; older ones go, damaged ones are left for inspection."""
    good = [p for p in complete_steps(root) if verify(p, hashes=False) is None]
    healthy = [p for p in good if unhealthy(p) is None]
    for old in good[:-max(keep, 1)] if keep > 0 else []:
        if not healthy or old != healthy[-1]:
            shutil.rmtree(old, ignore_errors=True)


# -------------------------------------------------------------------------------------- verify, load


def load_latest(root: Path, model_params: list, rank: RankInfo, shard: bool, identity: dict | None = None,
                log=print) -> tuple[Path, TrainerState, dict[str, np.ndarray]] | None:
    """Restore the newest checkpoint that verifies and loads on every rank; None when there is none.

    A damaged or unhealthy one, or a step directory without manifest, is skipped with a line naming
    the file and the reason. A checkpoint of another
    model or data, or one that cannot be resharded to this layout, raises :class:`CheckpointMismatch`.
    ``shard``: as for :func:`load_checkpoint`. Collective.
    """
    candidates = usable(root, log if rank.is_main else (lambda _: None))
    for path in candidates:
        problem, loaded = None, None
        try:
            loaded = _read(path, model_params, rank, shard, identity)
        except CheckpointMismatch:
            raise
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
            problem = str(e) if str(path) in str(e) else f"{path}: {type(e).__name__}: {e}"
        if not _world_sum([1.0 if problem else 0.0], rank)[0]:
            assert loaded is not None  # no rank had a problem, this one included
            state, weights, optim = loaded
            _apply(model_params, weights)
            return path, state, optim
        if problem or rank.is_main:
            log(f"[checkpoint] skipping {path}: {problem or 'another rank could not verify or load its files'}; "
                "trying the previous checkpoint")
    others = [p.name for p in step_dirs(root) if p not in candidates]
    if rank.is_main and (candidates or others):
        log(f"[checkpoint] no usable checkpoint in {root} ({len(candidates)} damaged, {len(others)} without a "
            f"manifest or unhealthy: {', '.join(others[:5])}): starting from step 0")
    return None


def load_checkpoint(path: Path, model_params: list, rank: RankInfo, shard: bool,
                    identity: dict | None = None) -> tuple[TrainerState, dict[str, np.ndarray]]:
    """Verify and restore one given checkpoint in place; return the trainer state and optimizer state.

    Any problem raises naming the file (train.resume=<path>). A checkpoint of another layout (tp, dp,
    vocab-parallel) is gathered and re-split for this one when the parameters are a model's (they
    carry ``hf_shape`` and ``tp_slice``, see ``finetune/io/reshard.py``); ``shard``: whether this run's
    optimizer is sharded over DP (the layout's ``shard_optimizer``), which decides the format of the
    returned optimizer state.
    """
    state, weights, optim = _read(path, model_params, rank, shard, identity)
    _apply(model_params, weights)
    return state, optim


def _verified(path: Path, names: list[str] | None = None) -> None:
    problem = verify(path, names)
    if problem:
        raise ValueError(problem)


def _read(path: Path, model_params: list, rank: RankInfo, shard: bool, identity: dict | None
          ) -> tuple[TrainerState, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Verify the files this rank reads, then read them: (state, weights, optimizer state); nothing applied.
    A checkpoint of another run (``identity``: model, data, method) is refused before its tensors are read."""
    import mindspore as ms

    _verified(path, [STATE])  # and the manifest itself
    manifest = json.loads((path / MANIFEST).read_text())
    state = TrainerState(**json.loads((path / STATE).read_text()))
    _check_identity(path, state.identity, identity)
    same = manifest["layout"]["tp"] == rank.tp and manifest["layout"]["world_size"] == rank.world_size
    model_file = _owner_file(path, "model", rank) if same else None
    if model_file is not None:
        _verified(path, [model_file.name])
    weights = load_file(str(model_file)) if same else {}
    fits = same and all(p.name in weights and tuple(weights[p.name].shape) == tuple(p.shape) for p in model_params)
    if not fits and all(hasattr(p, "hf_shape") for p in model_params):
        from finetune.io.reshard import SavedState, local_state

        _verified(path)  # resharding reads every rank's files
        saved = SavedState(path, [p.name for p in model_params], {p.name: p.hf_shape for p in model_params},
                           BUCKET_BYTES)
        weights, optim_state = local_state(saved, [(p.name, p.tp_slice, p.dtype == ms.float32) for p in model_params],
                                           rank.dp, rank.dp_rank, shard)
        return state, weights, optim_state
    if not same:
        raise CheckpointMismatch(f"{path}: written with layout {manifest['layout']}, this run has {layout(rank)}; "
                                 "resume with the same parallel.tp and worker count, or set train.resume=never")
    missing = [p.name for p in model_params if p.name not in weights]
    if missing:
        raise CheckpointMismatch(f"{model_file}: missing parameters {missing[:5]}; the checkpoint does not match "
                                 "this model — point train.resume at another checkpoint or set train.resume=never")
    wrong = [f"{p.name} {list(weights[p.name].shape)} vs {list(p.shape)}" for p in model_params
             if tuple(weights[p.name].shape) != tuple(p.shape)]
    if wrong:
        raise CheckpointMismatch(f"{model_file}: parameter shapes differ from this model's ({'; '.join(wrong[:3])}); "
                                 "it was written with another layout (parallel.vocab_parallel?) — resume with the "
                                 "settings that wrote it, or set train.resume=never")
    optim_file = _owner_file(path, "optim", rank)
    _verified(path, [optim_file.name])
    return state, weights, load_file(str(optim_file))


def _apply(model_params: list, weights: dict[str, np.ndarray]) -> None:
    import mindspore as ms

    for p in model_params:
        p.set_data(ms.Tensor(weights[p.name]).astype(p.dtype))


def _owner_file(path: Path, kind: str, rank: RankInfo) -> Path:
    """This rank's file, or the one of the data-parallel replica that stored it."""
    own = path / f"{kind}_rank{rank.rank:05d}.safetensors"
    if own.exists():
        return own
    replica = rank.tp_rank  # dp_rank 0 of this TP position is rank == tp_rank (TP groups contiguous)
    alt = path / f"{kind}_rank{replica:05d}.safetensors"
    if alt.exists():
        return alt
    raise FileNotFoundError(f"{path}: no {kind} file for rank {rank.rank}; the checkpoint is incomplete — "
                            "resume from an older one or set train.resume=never")
