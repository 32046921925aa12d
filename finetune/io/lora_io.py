"""LoRA adapters in and out in peft's format: ``adapter/`` (adapter_model.safetensors, adapter_config.json,
tokenizer files), the merged full model (``hf/``: base + scale * B @ A) and loading an adapter back.

Names: ours are the layer's path + ``.lora_A.weight`` (finetune/model/lora.py); peft's prefix them with
``base_model.model.`` and store ``modules_to_save`` weights under their own name with the same prefix.
Export is collective (TP slices gathered, see hf_io.gather_slice); only the main rank writes.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from finetune.dist import RankInfo
from finetune.io.hf_io import (
    EXPORT_DTYPES,
    TOKENIZER_FILES,
    _convert,
    _write_shard,
    gather_full,
    gather_slice,
    load_hf_config,
    read_tensor,
    weight_files,
    write_hf_dir,
)
from jobspec.checkpoint_index import other_base
from jobspec.fsutil import atomic_dir
from jobspec.hf_files import ADAPTER_BASE, ADAPTER_CONFIG, ADAPTER_FILE, read_header
from jobspec.lora_config import TARGETS, LoraConfig
from jobspec.model_layout import full_shapes
from jobspec.rundir import RunDir

PEFT_PREFIX = "base_model.model."


def adapter_identity(cfg: LoraConfig) -> str:
    """What a checkpoint's adapters are (compared on resume): rank, targets, saved modules."""
    return f"lora r={cfg.r} targets={','.join(cfg.target_modules)} save={','.join(cfg.modules_to_save)}"


def lora_identity(cfg: LoraConfig) -> dict:
    """What a LoRA run adds to its checkpoints' identity: ``method`` (compared on resume) and the whole
    ``lora`` section (read back by ``export --checkpoint``, see :func:`export_lora_checkpoint`)."""
    return {"method": adapter_identity(cfg), "lora": asdict(cfg)}


def peft_config(cfg: LoraConfig, base_model: str) -> dict:
    """adapter_config.json as peft writes it for a causal LM."""
    t = cfg.target_modules
    regex = len(t) == 1 and t[0] not in TARGETS
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": cfg.r,
            "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": t[0] if regex else sorted(t),
            "bias": cfg.bias, "use_rslora": cfg.use_rslora, "modules_to_save": cfg.modules_to_save or None,
            "init_lora_weights": "gaussian" if cfg.init == "gaussian" else True, "fan_in_fan_out": False,
            "inference_mode": True, "use_dora": False, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


def adapter_tensors(model, params: list, rank: RankInfo) -> dict[str, np.ndarray]:
    """Our name -> the full fp32 tensor of every trained parameter (collective over TP)."""
    shapes = model.hf_shapes()
    return {p.name: gather_slice(p.asnumpy().astype(np.float32), getattr(p, "hf_shape", None) or shapes[p.name],
                                 getattr(p, "tp_slice", None), rank) for p in params}


def write_adapter(out_dir: str | Path, tensors: dict[str, np.ndarray], cfg: LoraConfig, base_dir: str | Path,
                  base_hash: str, dtype: str = "fp32") -> Path:
    """``out_dir`` in peft's layout (written whole or not at all); tokenizer files from the base, and its identity
    (``base_hash``: checkpoints.model_hash of ``base_dir``) in ADAPTER_BASE, checked where the adapter is applied."""
    st_dtype = EXPORT_DTYPES[dtype][0]
    with atomic_dir(out_dir, "lora-adapter") as tmp:
        _write_shard(tmp / ADAPTER_FILE, {PEFT_PREFIX + n: _convert(a, dtype) for n, a in tensors.items()}, st_dtype)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(cfg, str(base_dir)), indent=2, sort_keys=True) + "\n")
        (tmp / ADAPTER_BASE).write_text(json.dumps({"model": base_hash, "model_dir": str(base_dir)}) + "\n")
        for name in TOKENIZER_FILES:
            if (Path(base_dir) / name).is_file():
                shutil.copyfile(Path(base_dir) / name, tmp / name)
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
    return Path(out_dir)


def merge_fetch(base: Callable[[str], np.ndarray], tensors: dict[str, np.ndarray], scale: float
                ) -> Callable[[str], np.ndarray]:
    """``fetch(name)`` of the full merged weights: ``base(name)`` + scale * B @ A, or a saved module."""

    def fetch(name: str) -> np.ndarray:
        if name in tensors:  # modules_to_save
            return tensors[name]
        w = base(name)
        a = tensors.get(name.removesuffix(".weight") + ".lora_A.weight")
        if a is None:
            return w
        b = tensors[name.removesuffix(".weight") + ".lora_B.weight"]
        return (w.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)

    return fetch


def merged_weights(model, tensors: dict[str, np.ndarray], cfg: LoraConfig, rank: RankInfo
                   ) -> Callable[[str], np.ndarray]:
    """:func:`merge_fetch` over the model's own base weights (gathered over TP: collective)."""
    state = model.hf_state()
    return merge_fetch(lambda name: gather_full(model, name, state[name], rank), tensors, cfg.scale)


def export_lora(model, params: list, cfg: LoraConfig, base_dir: str | Path, base_hash: str, run: RunDir, dtype: str,
                shard_size_bytes: int, merge: bool, rank: RankInfo) -> None:
    """``run.adapter`` (peft, fp32) and, with ``merge``, the merged model as ``run.hf`` in ``dtype``.
    Every rank calls it; only the main rank writes, DP rank 0's TP group gathering the TP slices (collectively): the
    other DP ranks return at once (under ZeRO-3 only DP rank 0 holds the whole weights, ``Training.host_weights``)."""
    if rank.dp_rank != 0:
        return
    tensors = adapter_tensors(model, params, rank)
    if rank.is_main:
        write_adapter(run.adapter, tensors, cfg, base_dir, base_hash)
    if merge:
        full = model.hf_shapes()
        write_hf_dir(run.hf if rank.is_main else None, base_dir, {n: full[n] for n in model.hf_state()},
                     merged_weights(model, tensors, cfg, rank), dtype, shard_size_bytes)


def export_lora_checkpoint(checkpoint: Path, identity: dict, model_dir: str | Path, out: str | Path, dtype: str,
                           shard_size_bytes: int, merge: bool) -> Path:
    """What the run's final export writes (:func:`export_lora`), from a LoRA checkpoint of any TP x DP
    layout and the base model on disk (numpy only, one process): ``out`` laid out as a run's export
    (``RunDir(out).adapter`` and, with ``merge``, ``RunDir(out).hf``). ``identity``: the checkpoint's (its
    ``lora`` section, see :func:`lora_identity`)."""
    from finetune.io.reshard import SavedState, rank_file
    from jobspec.memory import BUCKET_BYTES

    if "lora" not in identity:
        raise ValueError(f"{checkpoint}: a LoRA checkpoint without its lora settings (written by an older version); "
                         "export the run's final adapter/ instead, or train again")
    cfg = LoraConfig(**identity["lora"])
    shapes = full_shapes(load_hf_config(model_dir))
    names = list(read_header(rank_file(checkpoint, "model", 0))[0])
    full = {n: shapes.get(n) or adapter_shape(n, shapes, cfg.r) for n in names}
    saved = SavedState(checkpoint, names, full, BUCKET_BYTES)
    tensors = {n: saved.weights(n) for n in names}
    write_adapter(RunDir(out).adapter, tensors, cfg, model_dir, identity.get("model", ""))
    if merge:
        files = weight_files(model_dir)
        fetch = merge_fetch(lambda n: read_tensor(files[n], n), tensors, cfg.scale)
        write_hf_dir(RunDir(out).hf, model_dir, shapes, fetch, dtype, shard_size_bytes)
    return Path(out)


def adapter_shape(name: str, shapes: dict[str, tuple[int, ...]], r: int) -> tuple[int, ...]:
    """The full shape of adapter ``name``: A ``[r, in]``, B ``[out, r]`` of its layer's weight."""
    layer, kind = name.rsplit(".lora_", 1)
    if layer + ".weight" not in shapes or kind not in ("A.weight", "B.weight"):
        raise ValueError(f"{name}: not a LoRA adapter of this model's layers")
    out, fan_in = shapes[layer + ".weight"]
    return (r, fan_in) if kind == "A.weight" else (out, r)


def read_adapter(adapter_dir: str | Path) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """A peft LoRA directory: (its config, our name -> fp32 tensor)."""
    d = Path(adapter_dir)
    if not (d / ADAPTER_CONFIG).is_file() or not (d / ADAPTER_FILE).is_file():
        raise ValueError(f"{d}: no {ADAPTER_CONFIG} and {ADAPTER_FILE}; give a LoRA adapter directory in peft's "
                         "format, e.g. --adapter output/adapter")
    raw = json.loads((d / ADAPTER_CONFIG).read_text())
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{d / ADAPTER_CONFIG}: peft_type {raw.get('peft_type')!r} is not LORA")
    t = raw["target_modules"]
    cfg = LoraConfig(r=raw["r"], alpha=raw["lora_alpha"], dropout=0.0, use_rslora=bool(raw.get("use_rslora")),
                     target_modules=[t] if isinstance(t, str) else list(t),
                     modules_to_save=list(raw.get("modules_to_save") or []))
    names = read_header(d / ADAPTER_FILE)[0]
    return cfg, {n.removeprefix(PEFT_PREFIX): read_tensor(d / ADAPTER_FILE, n) for n in names}


def check_adapter_base(adapter_dir: str | Path, model_dir: str | Path) -> None:
    """ValueError when the adapter at ``adapter_dir`` records another base model than ``model_dir`` (e.g. a run's
    merged hf/); the run's remembered file hashes are used when the adapter is a run's adapter/."""
    try:
        recorded = json.loads((Path(adapter_dir) / ADAPTER_BASE).read_text())
    except (OSError, ValueError):
        return  # an adapter of peft's or an older version: nothing recorded
    hashes = RunDir(Path(adapter_dir).parent).hashes
    problem = other_base(recorded, model_dir, hashes if hashes.is_file() else None, f"the adapter {adapter_dir}")
    if problem:
        raise ValueError(problem)


def load_adapter(model, adapter_dir: str | Path) -> list:
    """Attach the adapter of ``adapter_dir`` to ``model`` (each TP rank its slices); its parameters."""
    import mindspore as ms

    from finetune.io.reshard import cut
    from finetune.model.lora import apply_lora

    cfg, tensors = read_adapter(adapter_dir)
    params = apply_lora(model, cfg, seed=0)
    missing = [p.name for p in params if p.name not in tensors]
    if missing:
        raise ValueError(f"{adapter_dir}: {ADAPTER_FILE} lacks {', '.join(missing[:3])}: not an adapter of this model")
    for p in params:
        p.set_data(ms.Tensor(cut(tensors[p.name], getattr(p, "tp_slice", None) or model.tp_layout.get(p.name)),
                             p.dtype))
    return params
