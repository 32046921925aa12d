"""Write a Hugging Face model directory from any saved training checkpoint (numpy only, one process).

    python finetune/export.py --checkpoint step_30 --output-dir output --model-dir /models/Qwen2.5-7B-Instruct

The checkpoint may come from any TP x DP layout (its slices are gathered by ``finetune/io/reshard.py``);
``config.json``, ``generation_config.json`` and the tokenizer come from the base model directory.
A LoRA run's checkpoint (adapters only) gives what the run's final export gives: ``<out>/adapter`` in
peft's format and, unless ``--no-merge``, the merged model ``<out>/hf`` (finetune/io/lora_io.py).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import cast

if __package__ in (None, ""):  # started as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetune.io.checkpoint import MANIFEST, verify
from finetune.io.hf_io import EXPORT_DTYPES, load_hf_config, write_hf_dir
from finetune.io.lora_io import export_lora_checkpoint
from finetune.io.reshard import SavedState
from jobspec.checkpoint_index import STATE, other_base, unhealthy, usable
from jobspec.config import parse_size
from jobspec.fsutil import ForeignDirectory, remove_stale_temps
from jobspec.memory import BUCKET_BYTES
from jobspec.model_layout import full_shapes
from jobspec.rundir import RunDir, is_complete, step_dirs, step_name


def newest_intact(root: Path) -> Path | None:
    """The newest complete, healthy checkpoint whose files are all there at their sizes: a newer one truncated or
    missing a file is passed over, saying why (its hashes are verified before the export as for any other)."""
    for path in usable(root, lambda line: print(line, file=sys.stderr)):
        problem = verify(path, hashes=False)
        if problem is None:
            return path
        print(f"[export] skipping {problem}; trying an older checkpoint", file=sys.stderr)
    return None


def resolve_checkpoint(name: str, output_dir: str | Path) -> Path:
    """A checkpoint directory from a path, ``step_N`` / ``N`` (under ``<output_dir>/checkpoints``) or ``latest``."""
    root = RunDir(output_dir).checkpoints
    m = re.fullmatch(r"(?:step_)?(\d+)", name)
    if name == "latest":
        path = newest_intact(root)
        if path is not None:
            print(f"[export] latest: {path.name}, the newest complete and healthy checkpoint", file=sys.stderr)
    else:
        path = root / step_name(int(m.group(1))) if m else Path(name)
    if path is not None and unhealthy(path):
        print(f"[export] warning: {unhealthy(path)}", file=sys.stderr)
    if path is None or not is_complete(path):
        done = [p.name for p in step_dirs(root) if is_complete(p)]
        raise ValueError(f"--checkpoint {name}: no complete checkpoint {path or ''} (one with {MANIFEST}); "
                         f"saved in {root}: {', '.join(done) or 'none'}")
    return path


def export_checkpoint(checkpoint: Path, model_dir: str | Path, out_dir: str | Path, dtype: str = "bf16",
                      shard_size_bytes: int = 2 * 10**9) -> Path:
    """Write the checkpoint's weights as a Hugging Face directory ``out_dir``; returns it."""
    shapes = full_shapes(load_hf_config(model_dir))
    saved = SavedState(checkpoint, list(shapes), shapes, BUCKET_BYTES)
    return cast(Path, write_hf_dir(out_dir, model_dir, shapes, saved.weights, dtype, shard_size_bytes))  # out_dir given


def check_out(out: Path, keep: list[Path]) -> None:
    """Refuse an ``--out`` that is, or holds, the checkpoint, the run directory or the base model."""
    target = out.resolve()
    for p in keep:
        if p.resolve() == target or target in p.resolve().parents:
            raise ForeignDirectory(f"--out {out}: holds {p}, which an export must never replace; choose a new "
                                   f"directory (e.g. --out {Path(keep[1]) / 'hf-export'})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="finetune.export", description="Write a Hugging Face directory from a "
                                 "training checkpoint of any TP x DP layout.")
    ap.add_argument("--checkpoint", required=True, help="step_N, N, latest, or a checkpoint directory")
    ap.add_argument("--output-dir", default="output", help="the run's output_dir (holds checkpoints/)")
    ap.add_argument("--model-dir", required=True, help="the base model (config.json, tokenizer)")
    ap.add_argument("--out", default=None, help="default: <output-dir>/hf-step_N")
    ap.add_argument("--dtype", default="bf16", choices=list(EXPORT_DTYPES))
    ap.add_argument("--shard-size", default="2GB", help="largest safetensors file (e.g. 2GB, 500MB)")
    ap.add_argument("--merge", action=argparse.BooleanOptionalAction, default=True,
                    help="a LoRA checkpoint: also write base + adapter merged to <out>/hf (<out>/adapter always)")
    args = ap.parse_args(argv)
    try:
        shard_size = parse_size(args.shard_size)
    except ValueError:
        shard_size = 0
    if shard_size <= 0:
        print(f"error: --shard-size {args.shard_size!r}: not a positive size; e.g. --shard-size 2GB or 500MB",
              file=sys.stderr)
        return 2
    try:
        ckpt = resolve_checkpoint(args.checkpoint, args.output_dir)
        out = Path(args.out) if args.out else RunDir(args.output_dir).export(ckpt)
        check_out(out, [ckpt, Path(args.output_dir), Path(args.model_dir)])
        remove_stale_temps(out.parent)
        problem = verify(ckpt)  # the rule train uses: a damaged checkpoint is named, never half-read
        if problem:
            raise ValueError(f"--checkpoint {args.checkpoint}: {problem}; export an older checkpoint "
                             f"(--checkpoint step_N)")
        identity = json.loads((ckpt / STATE).read_text()).get("identity", {})
        hashes = RunDir(args.output_dir).hashes
        base = other_base(identity, args.model_dir, hashes if hashes.is_file() else None, f"the checkpoint {ckpt}")
        if base:  # the run's tokenizer, template and weights, never another model's
            raise ValueError(base)
        if "method" in identity:  # train.method=lora: the checkpoint holds the adapters only
            remove_stale_temps(out)
            export_lora_checkpoint(ckpt, identity, args.model_dir, out, args.dtype, shard_size, args.merge)
        else:
            export_checkpoint(ckpt, args.model_dir, out, args.dtype, shard_size)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lora = "method" in identity
    dest = RunDir(out)  # a LoRA checkpoint's export is laid out as a run's: adapter/ and hf/
    print(f"[export] {ckpt} -> " + (f"{dest.adapter}" + (f" and {dest.hf}" if args.merge else "") if lora
                                    else f"{out}") + f" ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
