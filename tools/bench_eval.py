"""Multiple-choice scoring speed: our evaluator against lm-evaluation-harness's ``hf`` model, same model files,
same requests, same machine.

    make bench-eval                                   # TORCH_PYTHON: an interpreter with torch + lm-eval
    python tools/bench_eval.py --torch-python /work/torchvenv/bin/python --rounds 3 --copies 8 --json out.json

The model is a seeded Qwen2 of ``bench_train.SHAPE`` (hidden 512, 4 layers, vocab 151936, fp32) with the real
tokenizer; the requests are the mmlu documents of ``--data-dir`` (default: the tests' synthetic files), 0-shot,
four choices each, ``--copies`` numbered copies of them. Rounds interleave ours and lm-eval's (``HFLM.loglikelihood``
in its own process, kept alive between rounds); round 0 warms up. Prints tokens/s (the model's input tokens
per second) per side, the median ratio with min/max, the largest log-likelihood difference, the CPU and the
other work on the machine: when other processes average more than 0.5 runnable threads no ratio is
reported (NOT VALID). A tool, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # started as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_conditions import OtherWork, cpu_info, other_runnable, ratio_stats
from bench_train import SHAPE

ROOT = Path(__file__).resolve().parent.parent
LM_EVAL_WORKER = r'''
import json, sys, time
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

model_dir, requests_file, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
reqs = json.load(open(requests_file))
lm = HFLM(pretrained=model_dir, dtype="float32", device="cpu", batch_size=batch)
inst = [Instance(request_type="loglikelihood", doc={}, arguments=(c, x), idx=i) for i, (c, x) in enumerate(reqs)]
for line in sys.stdin:
    start = time.perf_counter()
    out = lm.loglikelihood(inst, disable_tqdm=True)
    print(json.dumps({"s": time.perf_counter() - start, "lls": [ll for ll, _ in out]}), flush=True)
'''


def requests(data_dir: Path, copies: int) -> list[tuple[str, str]]:
    """(context, continuation) of every mmlu document's four choices, 0-shot, ``copies`` times; copy ``k``'s
    contexts start with ``"(k) "``, so that every copy is a distinct document (neither side's reuse of identical
    requests is measured)."""
    from finetune.eval.tasks import choices, context, load_task
    from jobspec.eval_config import EvalConfig

    subs = load_task("mmlu", EvalConfig(tasks=["mmlu"], data_dir=str(data_dir), num_fewshot=0))
    one = [(context(s, i, None), c) for s in subs for i, d in enumerate(s.docs) for c in choices("mmlu", d, False)]
    return [(f"({k}) {c}", x) for k in range(copies) for c, x in one]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch-python", default=sys.executable, help="an interpreter with torch, transformers, lm-eval")
    ap.add_argument("--data-dir", type=Path, default=ROOT / "tests" / "finetune" / "eval" / "data")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    from finetune.eval import scoring
    from finetune.eval.report import load_scorer
    from jobspec.tiny import ensure_tiny_model

    reqs = requests(args.data_dir, args.copies)
    others = OtherWork(lambda: other_runnable(os.getpid()))
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp, others:
        model_dir, req_file = Path(tmp) / "model", Path(tmp) / "requests.json"
        ensure_tiny_model(model_dir, SHAPE, seed=0)
        req_file.write_text(json.dumps(reqs))
        (Path(tmp) / "worker.py").write_text(LM_EVAL_WORKER)
        theirs = subprocess.Popen([args.torch_python, str(Path(tmp) / "worker.py"), str(model_dir), str(req_file),
                                   str(args.batch_size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ours = load_scorer(str(model_dir), "cpu", chat=False)
        encoded = [scoring.encode_pair(ours.tok, c, x) for c, x in reqs]
        tokens = sum(len(c) + len(x) - 1 for c, x in encoded)
        seconds: dict[str, list[float]] = {"ours": [], "lm-eval": []}
        worst = 0.0
        for r in range(args.rounds + 1):
            start = time.perf_counter()
            lls = scoring.loglikelihoods(ours.model, encoded, args.batch_size, ours.max_length)
            s_ours = time.perf_counter() - start
            assert theirs.stdin is not None and theirs.stdout is not None
            theirs.stdin.write("go\n")
            theirs.stdin.flush()
            got = json.loads(theirs.stdout.readline())
            worst = max(worst, max(abs(a - b) for (a, _), b in zip(lls, got["lls"])))
            print(f"  round {r}: ours {tokens / s_ours:8.0f} tokens/s, lm-eval {tokens / got['s']:8.0f} tokens/s"
                  f"{'  (warm-up)' if r == 0 else ''}  others {others.mean():.2f}", flush=True)
            if r:
                seconds["ours"].append(s_ours)
                seconds["lm-eval"].append(got["s"])
        theirs.stdin.close()
        theirs.wait()
    cpu = cpu_info()
    valid = others.mean() <= 0.5
    result = {"requests": len(reqs), "tokens": tokens, "seconds": seconds, "max_abs_ll_diff": worst, "cpu": cpu,
              "other_runnable": others.mean(), "valid": valid,
              "ratio": ratio_stats(seconds["ours"], seconds["lm-eval"]) if valid else None}
    print(f"cpu: {cpu['model']}; {cpu['cores']} cores; {len(reqs)} requests, {tokens} tokens; largest "
          f"log-likelihood difference {worst:.2e}")
    print(f"ours / lm-eval tokens/s: {result['ratio']}" if valid else others.invalid())
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
