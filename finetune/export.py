"""Write a Hugging Face model directory from any saved training checkpoint (numpy only, one process).

    python finetune/export.py --checkpoint step_30 --output-dir output --model-dir /models/Qwen2.5-7B-Instruct

The checkpoint may come from any TP x DP layout (its slices are gathered by ``finetune/reshard.py``);
``config.json``, ``generation_config.json`` and the tokenizer come from the base model directory.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import cast

if __package__ in (None, ""):  # started as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetune.checkpoint import MANIFEST, checkpoint_root, find_latest  # noqa: E402  (sys.path set above)
from jobspec.config import parse_size  # noqa: E402  (sys.path set above)
from finetune.dist import BUCKET_BYTES  # noqa: E402  (sys.path set above)
from finetune.hf_io import EXPORT_DTYPES, load_hf_config, write_hf_dir  # noqa: E402  (sys.path set above)
from jobspec.qwen2_layout import full_shapes  # noqa: E402  (sys.path set above)
from finetune.reshard import SavedState  # noqa: E402  (sys.path set above)


def resolve_checkpoint(name: str, output_dir: str | Path) -> Path:
    """A checkpoint directory from a path, ``step_N`` / ``N`` (under ``<output_dir>/checkpoints``) or ``latest``."""
    root = checkpoint_root(output_dir)
    m = re.fullmatch(r"(?:step_)?(\d+)", name)
    path = find_latest(root) if name == "latest" else root / f"step_{int(m.group(1)):08d}" if m else Path(name)
    if path is None or not (path / MANIFEST).is_file():
        done = sorted(p.name for p in root.glob("step_*") if (p / MANIFEST).is_file())
        raise ValueError(f"--checkpoint {name}: no complete checkpoint {path or ''} (one with {MANIFEST}); "
                         f"saved in {root}: {', '.join(done) or 'none'}")
    return path


def export_checkpoint(checkpoint: Path, model_dir: str | Path, out_dir: str | Path, dtype: str = "bf16",
                      shard_size_bytes: int = 2 * 10**9) -> Path:
    """Write the checkpoint's weights as a Hugging Face directory ``out_dir``; returns it."""
    shapes = full_shapes(load_hf_config(model_dir))
    saved = SavedState(checkpoint, list(shapes), shapes, BUCKET_BYTES)
    return cast(Path, write_hf_dir(out_dir, model_dir, shapes, saved.weights, dtype, shard_size_bytes))  # out_dir given


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="finetune.export", description="Write a Hugging Face directory from a "
                                 "training checkpoint of any TP x DP layout.")
    ap.add_argument("--checkpoint", required=True, help="step_N, N, latest, or a checkpoint directory")
    ap.add_argument("--output-dir", default="output", help="the run's output_dir (holds checkpoints/)")
    ap.add_argument("--model-dir", required=True, help="the base model (config.json, tokenizer)")
    ap.add_argument("--out", default=None, help="default: <output-dir>/hf-step_N")
    ap.add_argument("--dtype", default="bf16", choices=list(EXPORT_DTYPES))
    ap.add_argument("--shard-size", default="2GB", help="largest safetensors file (e.g. 2GB, 500MB)")
    args = ap.parse_args(argv)
    try:
        ckpt = resolve_checkpoint(args.checkpoint, args.output_dir)
        out = Path(args.out) if args.out else Path(args.output_dir) / f"hf-{ckpt.name}"
        export_checkpoint(ckpt, args.model_dir, out, args.dtype, parse_size(args.shard_size))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[export] {ckpt} -> {out} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
