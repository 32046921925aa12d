"""What a compiled decoder layer holds on CPU (``train.compile_layers``): the ``graphs`` term's measurement.

    python tools/bench_graphs.py                      # the sweep (about 15 min on 2 cores): table and fit
    python tools/bench_graphs.py --json graphs.json   # the same, the rows also as JSON

Each point is a fresh process (``--probe``) that builds the bench's model shape (64-wide heads, 2 KV heads, FFN
2.75 x hidden, fp32) with a 256-token vocabulary, so that no logits count, and runs 3 forward + backward passes
(``value_and_grad`` over the trained parameters, as the loop does; LoRA: the adapters, their dropout masks drawn
ahead as the loop draws them). It prints its peak RSS (``VmHWM``) above its RSS once the model is built, after each
pass. For one shape (hidden, micro batch, sequence, full or LoRA) the sweep runs 2 and 4 layers, compiled
(``DecoderModel.compile_layers``) and op by op: per layer = (4 layers - 2 layers) / 2, and what the graphs hold
beyond op by op = compiled - op by op at the third pass (the steady state: the first is 3-15 % lower).

Fit (least squares over the full fine-tune shapes): per layer = a + b x the layer's fp32 weight bytes + c x the
micro-batch's tokens x hidden + d x its tokens x heads x sequence (the attention scores' elements), the constants
of ``jobspec/memory.py`` (``graph_bytes``). A tool, not a test (tests/test_bench_graphs.py tests its arithmetic).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # started as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_memory import shape_of

from jobspec.config import REPO_ROOT
from launcher.settings import CPU_MALLOC_DEFAULTS  # the malloc settings the launcher gives CPU workers

LAYERS = (2, 4)
# (hidden, micro batch, sequence, lora)
SHAPES = [(256, 1, 256, False), (256, 4, 256, False), (512, 1, 256, False), (512, 2, 256, False),
          (1024, 1, 256, False), (1024, 2, 256, False), (512, 1, 512, False), (256, 2, 512, False),
          (512, 2, 256, True), (256, 4, 256, True), (1024, 1, 256, True)]
MIB = 2**20


def model_config(hidden: int, layers: int) -> dict:
    """The bench's shape (tools/bench_memory.py ``shape_of``) with a 256-token vocabulary and an untied head."""
    return {**shape_of(hidden, layers), "vocab_size": 256, "tie_word_embeddings": False}


def probe(layers: int, hidden: int, micro_batch: int, seq: int, compiled: bool, lora: bool, passes: int = 3) -> None:
    """In this process: build, run ``passes`` forward + backward passes, print the peaks above the built model."""
    import mindspore as ms
    import numpy as np

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    from finetune.model.decoder import DecoderLM, ModelConfig
    from finetune.run.perf import peak_rss_bytes, rss_bytes

    model = DecoderLM(ModelConfig.from_dict(model_config(hidden, layers)))
    if compiled:
        model.model.compile_layers()
    model.cast_params(ms.float32)
    params = model.trainable_params()
    if lora:
        from finetune.model.lora import apply_lora
        from jobspec.lora_config import LoraConfig

        params = apply_lora(model, LoraConfig(), 0)
    model.set_train(True)
    ids = ms.Tensor(np.random.default_rng(0).integers(0, 256, (micro_batch, seq)).astype(np.int32))
    pos = ms.Tensor(np.tile(np.arange(seq, dtype=np.int32), (micro_batch, 1)))
    seg = ms.Tensor(np.ones((micro_batch, seq), np.int32))
    grad_fn = ms.value_and_grad(lambda *a: model(*a), None, params)
    base = rss_bytes()
    peaks = []
    for i in range(passes):
        masks = getattr(model, "lora_masks", None)
        if masks is not None:
            masks.advance(i, ids.shape)
        loss, grads = grad_fn(ids, ids, pos, seg)
        float(loss.asnumpy())
        del grads
        peaks.append(peak_rss_bytes() - base)
    print(json.dumps({"peaks": peaks}))


def run_probe(layers: int, hidden: int, micro_batch: int, seq: int, compiled: bool, lora: bool) -> list[int]:
    """One probe in a fresh process (the launcher's malloc settings): its peaks after each pass."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", str(layers), str(hidden), str(micro_batch),
           str(seq), str(int(compiled)), str(int(lora))]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env={**os.environ, **CPU_MALLOC_DEFAULTS}, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"probe {cmd[3:]} failed (rc {out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peaks"]


def layer_weight_bytes(hidden: int) -> int:
    """fp32 bytes of one decoder layer's weights at the bench's shape."""
    from jobspec.memory import layer_weight_elements

    return 4 * layer_weight_elements(model_config(hidden, 1))


def per_layer(peaks: dict[tuple[int, bool], list[int]], at: int = -1) -> tuple[float, float]:
    """(compiled, op by op) bytes per layer at pass ``at`` from the 2- and 4-layer peaks keyed (layers, compiled)."""
    lo, hi = LAYERS
    return tuple((peaks[hi, c][at] - peaks[lo, c][at]) / (hi - lo) for c in (True, False))


def features(hidden: int, micro_batch: int, seq: int) -> list[float]:
    """The fit's regressors: 1, the layer's fp32 weight bytes, tokens x hidden, tokens x heads x sequence."""
    tokens = micro_batch * seq
    return [1.0, float(layer_weight_bytes(hidden)), float(tokens * hidden), float(tokens * (hidden // 64) * seq)]


def fit(rows: list[dict]) -> list[float]:
    """Least-squares coefficients of :func:`features` for the rows' ``graphs`` bytes per layer (full rows)."""
    import numpy as np

    full = [r for r in rows if not r["lora"]]
    a = np.array([features(r["hidden"], r["micro_batch"], r["seq"]) for r in full])
    return [float(c) for c in np.linalg.lstsq(a, np.array([r["graphs"] for r in full]), rcond=None)[0]]


def predict(coef: list[float], hidden: int, micro_batch: int, seq: int) -> float:
    return sum(c * f for c, f in zip(coef, features(hidden, micro_batch, seq)))


def table(rows: list[dict], coef: list[float]) -> str:
    """The Markdown table: per layer, MiB."""
    out = ["| hidden | micro batch | seq | method | compiled / layer | op by op / layer | graphs / layer (first pass) "
           "| graphs / layer | jobspec/memory.py | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    from jobspec.memory import graph_bytes

    for r in rows:
        est = graph_bytes(model_config(r["hidden"], 1), r["micro_batch"] * r["seq"], r["seq"], r["lora"])
        out.append(f"| {r['hidden']} | {r['micro_batch']} | {r['seq']} | {'lora' if r['lora'] else 'full'} "
                   f"| {r['compiled'] / MIB:.0f} | {r['op_by_op'] / MIB:.0f} | {r['graphs_first'] / MIB:.0f} "
                   f"| {r['graphs'] / MIB:.0f} | {est / MIB:.0f} | {r['graphs'] / est:.2f} |")
    names = ("a (bytes)", "b (per weight byte)", "c (per token x hidden)", "d (per token x head x position)")
    out.append("\nfit: " + ", ".join(f"{n} {c:.3g}" for n, c in zip(names, coef)))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", nargs=6, type=int, metavar=("LAYERS", "HIDDEN", "MB", "SEQ", "COMPILED", "LORA"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.probe:
        layers, hidden, mb, seq, compiled, lora = args.probe
        probe(layers, hidden, mb, seq, bool(compiled), bool(lora))
        return 0
    rows = []
    for hidden, mb, seq, lora in SHAPES:
        peaks = {(n, c): run_probe(n, hidden, mb, seq, c, lora) for n in LAYERS for c in (True, False)}
        (compiled, op), (first_c, first_o) = per_layer(peaks), per_layer(peaks, 0)
        rows.append({"hidden": hidden, "micro_batch": mb, "seq": seq, "lora": lora, "compiled": compiled,
                     "op_by_op": op, "graphs": compiled - op, "graphs_first": first_c - first_o, "peaks":
                     {f"{n}-{'compiled' if c else 'op'}": p for (n, c), p in peaks.items()}})
        print(f"[bench-graphs] h{hidden} mb{mb} s{seq} {'lora' if lora else 'full'}: graphs "
              f"{(compiled - op) / MIB:.0f} MiB per layer", file=sys.stderr, flush=True)
    coef = fit(rows)
    print(table(rows, coef))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "fit": coef}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
