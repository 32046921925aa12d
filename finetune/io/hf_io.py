"""Hugging Face model directories in and out: config.json, safetensors (single or sharded).

No torch: tensors are read with numpy memory maps from the safetensors layout (so bf16 works and
each rank reads only its tensor-parallel slice) and written with the ``safetensors`` library.
Export gathers TP slices, then only rank 0 writes, to a temporary directory that is renamed
(``fsutil.atomic_dir``).
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize_file

from finetune.dist import RankInfo
from jobspec.fsutil import atomic_dir
from jobspec.hf_files import INDEX, SINGLE, read_header

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
EXPORT_DTYPES = {"bf16": ("bfloat16", 2), "fp16": ("float16", 2), "fp32": ("float32", 4)}  # torch_dtype, bytes


class HFModelError(ValueError):
    """A problem with a Hugging Face model directory; the message names the file and the fix."""


def load_hf_config(model_dir: str | os.PathLike) -> dict:
    """``config.json`` of a model directory as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise HFModelError(f"{path}: not found; model.dir (MODEL_DIR) must be a Hugging Face model directory "
                           "with config.json and *.safetensors (e.g. a snapshot of Qwen/Qwen2.5-7B-Instruct)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFModelError(f"{path}: not valid JSON ({e}); restore the file from the model's source") from None


# ---------------------------------------------------------------------------- reading

def bf16_to_fp32(a: np.ndarray) -> np.ndarray:
    """Raw bf16 bits (uint16) -> float32."""
    return (a.astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> raw bf16 bits (uint16), rounding to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    out[np.isnan(a)] = 0x7FC0
    return out


def weight_files(model_dir: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> safetensors file, from ``model.safetensors`` or the sharded index."""
    d = Path(model_dir)
    index = d / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        missing = sorted({f for f in weight_map.values() if not (d / f).is_file()})
        if missing:
            raise HFModelError(f"{index}: names shard(s) {', '.join(missing)} that are not in {d}; "
                               "copy the missing files (all shards listed in the index) into the model directory")
        return {name: d / f for name, f in weight_map.items()}
    if (d / SINGLE).is_file():
        header, _ = read_header(d / SINGLE)
        return {name: d / SINGLE for name in header}
    raise HFModelError(f"{d}: no {SINGLE} or {INDEX}; the model directory needs safetensors weights "
                       "(convert .bin weights with transformers' save_pretrained(safe_serialization=True))")


def _mapped(path: Path, name: str, part: tuple[int, int, int] | None) -> tuple[np.ndarray, str]:
    """Tensor ``name`` of a safetensors file (its slice ``part`` = (axis, start, size)) as a view of the file's
    memory map, no copy; (view, safetensors dtype)."""
    header, data_start = read_header(path)
    meta = header[name]
    if meta["dtype"] not in _NP:
        raise HFModelError(f"{path}: tensor {name} has dtype {meta['dtype']}; supported: {', '.join(_NP)}")
    begin = meta["data_offsets"][0]
    shape = tuple(meta["shape"])
    a = np.asarray(np.memmap(path, dtype=_NP[meta["dtype"]], mode="r", offset=data_start + begin, shape=shape))
    if part is not None:
        axis, start, size = part
        a = a[start:start + size] if axis == 0 else a[:, start:start + size]
    return a, meta["dtype"]


def read_tensor(path: Path, name: str, part: tuple[int, int, int] | None = None) -> np.ndarray:
    """Tensor ``name`` of a safetensors file as float32 (one copy); ``part`` = (axis, start, size): a slice only."""
    a, dtype = _mapped(path, name, part)
    return bf16_to_fp32(a) if dtype == "BF16" else a.astype(np.float32)


def read_into(out: np.ndarray, path: Path, name: str, part: tuple[int, int, int] | None = None) -> None:
    """Tensor ``name`` (its slice ``part``) converted to float32 straight into ``out``: no copy of it in memory."""
    a, dtype = _mapped(path, name, part)
    if dtype == "BF16":
        np.left_shift(a, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, a, casting="same_kind")


def check_weights(model_dir: str | os.PathLike, shapes: dict[str, tuple[int, ...]]) -> dict[str, Path]:
    """Tensor name -> file, once the weight files hold every tensor of ``shapes`` in that shape.

    Reads only the safetensors headers, so a model can be checked before it is built; every
    missing tensor and shape mismatch is reported at once.
    """
    files = weight_files(model_dir)
    headers = {p: read_header(p)[0] for p in set(files.values())}
    problems = []
    for name, shape in shapes.items():
        if name not in files:
            problems.append(f"{name}: missing from {model_dir} (expected shape {list(shape)})")
            continue
        found = headers[files[name]][name]["shape"]
        if tuple(found) != tuple(shape):
            problems.append(f"{files[name]}: tensor {name} has shape {found}, config.json expects "
                            f"{list(shape)}; use the config.json that belongs to these weights")
    if problems:
        raise HFModelError("weights do not match the model config:\n" + "\n".join(f"  - {p}" for p in problems))
    return files


def load_weights(model, model_dir: str | os.PathLike, rank: RankInfo | None = None) -> None:
    """Fill ``model``'s parameters from the HF directory; each rank reads only its TP slices.

    Every missing tensor and shape mismatch is reported at once, before anything is loaded.
    The slices follow ``model.rank`` (``rank``, when given, must be the same).
    """
    import mindspore as ms

    if rank is not None and rank != model.rank:
        raise ValueError(f"load_weights: rank {rank} differs from the model's {model.rank}; build the model with it")
    shapes = model.hf_shapes()
    files = check_weights(model_dir, {name: shapes[name] for name in model.hf_state()})
    layout = model.tp_layout
    in_place = model.rank.platform.host_memory  # asnumpy() is then the parameter's own storage
    for name, param in model.hf_state().items():
        part = layout.get(name)
        if in_place:  # no host copy left behind (glibc keeps freed heap: the load's copies would stay in the RSS)
            read_into(param.asnumpy(), files[name], name, part[:3] if part else None)
        else:
            param.set_data(ms.Tensor(read_tensor(files[name], name, part[:3] if part else None), ms.float32))


# ---------------------------------------------------------------------------- export

def gather_full(model, name: str, param, rank: RankInfo) -> np.ndarray:
    """The full fp32 tensor of a (possibly TP-split) parameter, on every rank of the TP group.

    AllGather only works on the world group on CPU, so each rank places its slice into zeros and
    the TP group sums them with AllReduce (replicated copies are counted once via ``owner``).
    """
    return gather_slice(param.asnumpy().astype(np.float32), model.hf_shapes()[name], model.tp_layout.get(name), rank)


def gather_slice(local: np.ndarray, shape: tuple[int, ...], part, rank: RankInfo) -> np.ndarray:
    """The full tensor of ``shape`` from each TP rank's slice ``local`` (``part``: its TPSlice, None:
    held whole); collective over the TP group (see :func:`gather_full`)."""
    if part is None or rank.tp == 1:
        return local
    import mindspore as ms
    from mindspore import ops

    full = np.zeros(shape, np.float32)
    if part.owner:
        index = [slice(None)] * full.ndim
        index[part.axis] = slice(part.start, part.start + part.size)
        full[tuple(index)] = local
    return ops.AllReduce(ops.ReduceOp.SUM, rank.tp_group)(ms.Tensor(full)).asnumpy()


def plan_shards(sizes: list[tuple[str, int]], shard_size_bytes: int) -> list[list[str]]:
    """Greedy split in order, like transformers: a new shard when the next tensor would overflow."""
    shards: list[list[str]] = [[]]
    current = 0
    for name, size in sizes:
        if shards[-1] and current + size > shard_size_bytes:
            shards.append([])
            current = 0
        shards[-1].append(name)
        current += size
    return shards


def _check_dtype(dtype: str) -> None:
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export.dtype={dtype!r}: must be one of {', '.join(EXPORT_DTYPES)} (e.g. export.dtype=bf16)")


def _convert(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return fp32_to_bf16(a)
    return a.astype(np.float16 if dtype == "fp16" else np.float32)


class NonFiniteWeights(ValueError):
    """An export would hold non-finite weights (in its dtype); nothing was written."""


def _finite(tensors: dict[str, np.ndarray], dtype: str) -> None:
    """Raise :class:`NonFiniteWeights` naming the first tensor with a non-finite value once converted to
    ``dtype`` (bf16: the bits of an exponent of all ones)."""
    for name, a in tensors.items():
        bad = int(((a & 0x7F80) == 0x7F80).sum()) if dtype == "bf16" else int((~np.isfinite(a)).sum())
        if bad:
            raise NonFiniteWeights(f"{name}: {bad:,} non-finite values in {dtype}: the weights are blown up or "
                                   f"out of {dtype}'s range; nothing was exported")


def _write_shard(path: Path, tensors: dict[str, np.ndarray], st_dtype: str) -> None:
    specs = {n: TensorSpec(dtype=st_dtype, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
             for n, a in tensors.items()}
    serialize_file(specs, str(path), metadata={"format": "pt"})


def _write_configs(src: Path, tmp: Path, dtype: str) -> None:
    config = load_hf_config(src)
    torch_dtype = EXPORT_DTYPES[dtype][0]
    config["torch_dtype"] = torch_dtype
    if "dtype" in config:
        config["dtype"] = torch_dtype
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (src / "generation_config.json").is_file():
        shutil.copyfile(src / "generation_config.json", tmp / "generation_config.json")
    else:
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copyfile(src / f, tmp / f)


def write_hf_dir(out_dir: str | os.PathLike[str] | None, src_model_dir: str | os.PathLike[str],
                 shapes: dict[str, tuple[int, ...]], fetch: Callable[[str], np.ndarray], dtype: str = "bf16",
                 shard_size_bytes: int = 2 * 10**9) -> Path | None:
    """Write the tensors ``fetch(name)`` (fp32, full ``shapes``, in order) as a Hugging Face directory
    like ``save_pretrained``, with the configs and tokenizer of ``src_model_dir``.

    ``out_dir`` None: only fetch, in the same order (a rank taking part in collective gathers).
    Readable by others (directory 0755, files 0644), e.g. by a non-root serving container. Non-finite
    weights raise :class:`NonFiniteWeights` before the directory is published.
    """
    _check_dtype(dtype)
    st_dtype, itemsize = EXPORT_DTYPES[dtype]
    sizes = [(n, int(np.prod(shape)) * itemsize) for n, shape in shapes.items()]
    shards = plan_shards(sizes, shard_size_bytes)
    names = [SINGLE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with atomic_dir(Path(out_dir), "hf-export") if out_dir is not None else nullcontext(None) as tmp:
        for file, members in zip(names, shards):
            tensors = {n: _convert(fetch(n), dtype) for n in members}
            _finite(tensors, dtype)  # the ranks fetching (a whole TP group) fetch the same tensors: all stop
            if tmp is not None:
                _write_shard(tmp / file, tensors, st_dtype)
        if tmp is None:
            return None
        if len(shards) > 1:
            index = {"metadata": {"total_parameters": sum(s for _, s in sizes) // itemsize,
                                  "total_size": sum(s for _, s in sizes)},
                     "weight_map": {n: f for f, members in zip(names, shards) for n in members}}
            (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _write_configs(Path(src_model_dir), tmp, dtype)  # modes: fsutil.publish's rule
    return Path(out_dir) if out_dir is not None else None


def export_hf(model, src_model_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bf16",
              shard_size_bytes: int = 2 * 10**9, rank: RankInfo | None = None) -> Path | None:
    """Write ``model`` as a Hugging Face directory (:func:`write_hf_dir`); returns the path on rank 0.

    Every rank must call it; only rank 0 writes, DP rank 0's TP group gathering the TP slices (collectively): the
    other DP ranks return at once (under ZeRO-3 only DP rank 0 holds the whole weights, ``Training.host_weights``).
    """
    rank = rank or model.rank
    _check_dtype(dtype)
    if rank.dp_rank != 0:
        return None
    state, full = model.hf_state(), model.hf_shapes()
    return write_hf_dir(out_dir if rank.is_main else None, src_model_dir, {n: full[n] for n in state},
                        lambda n: gather_full(model, n, state[n], rank), dtype, shard_size_bytes)
