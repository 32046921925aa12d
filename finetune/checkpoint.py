"""Resumable training checkpoints, written atomically.

Layout: ``<output_dir>/checkpoints/step_00000030/`` holding, per rank that owns something,
``model_rank00000.safetensors`` (this rank's parameters, fp32) and ``optim_rank00000.safetensors``
(its optimizer state), plus ``trainer_state.json`` (step, data position, loss scale, RNG seed,
layout) and, written last, ``manifest.json``. Everything goes to ``step_N.tmp`` first and is renamed
once every rank has finished, so a crash never leaves a checkpoint that looks complete.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from finetune.dist import RankInfo, barrier

MANIFEST = "manifest.json"


@dataclass
class TrainerState:
    """What besides tensors a resumed run needs to continue exactly."""

    step: int
    loader: dict
    scaler: dict
    seed: int
    tokens_seen: int = 0
    elapsed_s: float = 0.0


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def layout(rank: RankInfo) -> dict:
    return {"world_size": rank.world_size, "tp": rank.tp, "dp": rank.dp}


def save_checkpoint(root: Path, state: TrainerState, model_params: list, optim_state: dict[str, np.ndarray],
                    rank: RankInfo, keep: int, owns_model: bool = True, owns_optim: bool = True) -> Path:
    """Write this rank's share; rank 0 writes the manifest and publishes the directory.

    ``owns_model`` / ``owns_optim``: whether this rank's copy must be stored (replicas across
    data-parallel ranks are stored once). Collective: every rank must call it at the same step.
    """
    final = _step_dir(root, state.step)
    tmp = final.with_name(final.name + ".tmp")
    if rank.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(rank)
    tmp.mkdir(parents=True, exist_ok=True)  # other nodes without shared storage
    r = f"rank{rank.rank:05d}"
    if owns_model:
        save_file({p.name: p.asnumpy().astype(np.float32) for p in model_params}, str(tmp / f"model_{r}.safetensors"))
    if owns_optim:
        save_file({k: np.ascontiguousarray(v) for k, v in optim_state.items()}, str(tmp / f"optim_{r}.safetensors"))
    barrier(rank)
    if rank.is_main:
        (tmp / "trainer_state.json").write_text(json.dumps(state.__dict__, indent=1))
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / MANIFEST).write_text(json.dumps({"step": state.step, "layout": layout(rank), "files": files},
                                               indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _prune(root, keep)
    barrier(rank)
    if rank.local_rank == 0 and tmp.exists() and not final.exists():  # node-local storage
        tmp.rename(final)
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if (p / MANIFEST).is_file())
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def find_latest(root: Path) -> Path | None:
    """Newest complete checkpoint (one with a manifest), or None."""
    done = sorted(p for p in root.glob("step_*") if p.suffix != ".tmp" and (p / MANIFEST).is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path, model_params: list, rank: RankInfo) -> tuple[TrainerState, dict[str, np.ndarray]]:
    """Restore this rank's parameters in place; return the trainer state and optimizer state.

    The layout must match the one that wrote it (same tp and world size).
    """
    import mindspore as ms

    manifest = json.loads((path / MANIFEST).read_text())
    if manifest["layout"]["tp"] != rank.tp or manifest["layout"]["world_size"] != rank.world_size:
        raise ValueError(f"{path}: written with layout {manifest['layout']}, this run has {layout(rank)}; "
                         "resume with the same parallel.tp and worker count, or set train.resume=never")
    model_file = _owner_file(path, "model", rank)
    weights = load_file(str(model_file))
    missing = [p.name for p in model_params if p.name not in weights]
    if missing:
        raise ValueError(f"{model_file}: missing parameters {missing[:5]}; the checkpoint does not match "
                         "this model — point train.resume at another checkpoint or set train.resume=never")
    wrong = [f"{p.name} {list(weights[p.name].shape)} vs {list(p.shape)}" for p in model_params
             if tuple(weights[p.name].shape) != tuple(p.shape)]
    if wrong:
        raise ValueError(f"{model_file}: parameter shapes differ from this model's ({'; '.join(wrong[:3])}); "
                         "it was written with another layout (parallel.vocab_parallel?) — resume with the "
                         "settings that wrote it, or set train.resume=never")
    for p in model_params:
        p.set_data(ms.Tensor(weights[p.name]).astype(p.dtype))
    optim_file = _owner_file(path, "optim", rank)
    state = TrainerState(**json.loads((path / "trainer_state.json").read_text()))
    return state, load_file(str(optim_file))


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
