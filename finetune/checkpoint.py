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

from finetune.dist import BUCKET_BYTES, RankInfo, barrier

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


def load_checkpoint(path: Path, model_params: list, rank: RankInfo,
                    shard: bool | None = None) -> tuple[TrainerState, dict[str, np.ndarray]]:
    """Restore this rank's parameters in place; return the trainer state and optimizer state.

    A checkpoint of another layout (tp, dp, vocab-parallel) is gathered and re-split for this one
    when the parameters are a model's (they carry ``hf_shape`` and ``tp_slice``, see
    ``finetune/reshard.py``); ``shard``: whether this run's optimizer is sharded over DP (None: when
    dp > 1, the default), which decides the format of the returned optimizer state.
    """
    import mindspore as ms

    manifest = json.loads((path / MANIFEST).read_text())
    state = TrainerState(**json.loads((path / "trainer_state.json").read_text()))
    same = manifest["layout"]["tp"] == rank.tp and manifest["layout"]["world_size"] == rank.world_size
    model_file = _owner_file(path, "model", rank) if same else None
    weights = load_file(str(model_file)) if same else {}
    fits = same and all(p.name in weights and tuple(weights[p.name].shape) == tuple(p.shape) for p in model_params)
    if not fits and all(hasattr(p, "hf_shape") for p in model_params):
        from finetune.reshard import SavedState, local_state

        saved = SavedState(path, [p.name for p in model_params], {p.name: p.hf_shape for p in model_params},
                           BUCKET_BYTES)
        weights, optim_state = local_state(saved, [(p.name, p.tp_slice, p.dtype == ms.float32) for p in model_params],
                                           rank.dp, rank.dp_rank, rank.dp > 1 if shard is None else shard)
        for p in model_params:
            p.set_data(ms.Tensor(weights[p.name]).astype(p.dtype))
        return state, optim_state
    if not same:
        raise ValueError(f"{path}: written with layout {manifest['layout']}, this run has {layout(rank)}; "
                         "resume with the same parallel.tp and worker count, or set train.resume=never")
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
