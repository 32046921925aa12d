"""Sampling and the generate CLI."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from finetune.generate import chat_prompt, generate, main, next_token

GOLDEN = Path(__file__).resolve().parent / "golden"
ASSETS = Path(__file__).resolve().parents[2] / "assets" / "tokenizer"


def test_next_token_rules():
    rng = np.random.default_rng(0)
    logits = np.array([1.0, 3.0, 2.9, -1.0], np.float32)
    assert next_token(logits, [], 0.0, 1.0, 1.0, rng) == 1
    assert next_token(logits, [1], 0.0, 1.0, 1.5, rng) == 2  # 3/1.5 < 2.9
    assert next_token(np.array([-1.0, -0.5]), [1], 0.0, 1.0, 2.0, rng) == 0  # negatives are multiplied
    assert {next_token(logits, [], 1.0, 0.01, 1.0, rng) for _ in range(20)} == {1}  # top_p keeps the best
    seen = {next_token(logits, [], 1.0, 1.0, 1.0, rng) for _ in range(200)}
    assert {1, 2} <= seen
    a = [next_token(logits, [], 0.7, 0.9, 1.1, np.random.default_rng(5)) for _ in range(5)]
    b = [next_token(logits, [], 0.7, 0.9, 1.1, np.random.default_rng(5)) for _ in range(5)]
    assert a == b


class _Tok:
    def __init__(self, stop: int):
        self.stop = stop

    def token_to_id(self, t):
        return self.stop if t == "<|im_end|>" else None


def test_greedy_generate_follows_full_logits(ms_cpu):
    import mindspore as ms

    from finetune.hf_io import load_hf_config, load_weights
    from finetune.model import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config.from_dict(load_hf_config(GOLDEN / "tied")))
    load_weights(model, GOLDEN / "tied")
    prompt = [5, 17, 99]
    out = generate(model, _Tok(-1), prompt, 8, temperature=0, repetition_penalty=1.0)
    # greedy with the key/value cache: each new token is the argmax of the full-sequence logits
    # (no cache) at the position before it
    logits = model.logits(ms.Tensor(np.array([prompt + out], np.int32))).asnumpy()[0]
    assert len(out) == 8 and out == [int(x) for x in logits[len(prompt) - 1:-1].argmax(-1)]
    caches = model.new_caches()
    model.last_logits(ms.Tensor(np.array([prompt + out[:3]], np.int32)), caches)
    step = model.last_logits(ms.Tensor(np.array([out[3:5]], np.int32)), caches).asnumpy()[0]  # 2 new at once
    np.testing.assert_allclose(step, logits[len(prompt) + 4], atol=1e-5)
    assert caches[0][0].shape[1] == len(prompt) + 5  # BSND keys
    stop = out[-1]
    assert generate(model, _Tok(stop), prompt, 3, temperature=0, repetition_penalty=1.0) == out[:out.index(stop)]


def test_chat_prompt_uses_special_tokens():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    ids = tok.encode(chat_prompt("Hi"), add_special_tokens=False).ids
    assert ids[0] == 151644 and ids.count(151645) == 2 and ids[-2:] == [77091, 198]  # "assistant\n"


def test_cli(ms_cpu, tiny_hf_dir, capsys):
    d = tiny_hf_dir(vocab_size=151936, hidden_size=16, intermediate_size=32)
    assert main(["--model-dir", str(d), "--prompt", "Hello", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["--model-dir", str(d.parent / "nope"), "--prompt", "x"]) == 2
    assert "config.json" in capsys.readouterr().err
