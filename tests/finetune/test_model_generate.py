"""Sampling, batched generation with the key/value cache, and the generate CLI."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from finetune.generate import Sampling, chat_prompt, generate, main, next_token
from jobspec.rundir import RunDir

GOLDEN = Path(__file__).resolve().parent / "golden"
ASSETS = Path(__file__).resolve().parents[2] / "assets" / "tokenizer"
GREEDY = Sampling(temperature=0, repetition_penalty=1.0, max_new_tokens=8)


def test_next_token_rules():
    rng = np.random.default_rng(0)
    logits = np.array([1.0, 3.0, 2.9, -1.0], np.float32)
    assert next_token(logits, [], 0.0, 1.0, 1.0, rng) == 1
    assert next_token(logits, [1], 0.0, 1.0, 1.5, rng) == 2  # 3/1.5 < 2.9
    assert next_token(np.array([-1.0, -0.5]), [1], 0.0, 1.0, 2.0, rng) == 0  # negatives are multiplied
    assert {next_token(logits, [], 1.0, 0.01, 1.0, rng) for _ in range(20)} == {1}  # top_p keeps the best
    seen = {next_token(logits, [], 1.0, 1.0, 1.0, rng) for _ in range(200)}
    assert {1, 2} <= seen
    assert {next_token(logits, [], 5.0, 1.0, 1.0, rng, top_k=2) for _ in range(200)} == {1, 2}  # top_k cuts
    a = [next_token(logits, [], 0.7, 0.9, 1.1, np.random.default_rng(5)) for _ in range(5)]
    b = [next_token(logits, [], 0.7, 0.9, 1.1, np.random.default_rng(5)) for _ in range(5)]
    assert a == b


def _golden(case: str):
    from finetune.io.hf_io import load_hf_config, load_weights
    from finetune.model.decoder import DecoderLM, ModelConfig

    model = DecoderLM(ModelConfig.from_dict(load_hf_config(GOLDEN / case)))
    load_weights(model, GOLDEN / case)
    return model


@pytest.fixture(scope="module")
def tied(ms_cpu):
    return _golden("tied")


@pytest.mark.parametrize("case", ["tied", "qwen3-untied"])
def test_greedy_generate_follows_full_logits(ms_cpu, tied, case):
    """Qwen3: the cached keys are the normalized ones (k_norm before RoPE)."""
    ms, model = ms_cpu, tied if case == "tied" else _golden(case)
    prompt = [5, 17, 99]
    (out,) = generate(model, [prompt], set(), GREEDY)
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
    assert generate(model, [prompt], {stop}, GREEDY) == [out[:out.index(stop)]]


def test_batched_left_padded_rows_equal_each_prompt_alone(tied):
    prompts = [[5, 17, 99, 3, 8, 41], [7, 2], [250, 11, 90, 4]]
    short = dataclasses.replace(GREEDY, max_new_tokens=5)  # 5 decode steps show it as well as 8, sooner
    alone = [generate(tied, [p], set(), short)[0] for p in prompts]
    assert generate(tied, prompts, set(), short, pad_id=0) == alone
    stop = alone[1][2]  # row 1 stops early; the others go on unchanged
    batched = generate(tied, prompts, {stop}, short)
    assert batched == [a[:a.index(stop)] if stop in a else a for a in alone]


def test_chat_prompt_is_the_training_template():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    ids = tok.encode(chat_prompt("Hi"), add_special_tokens=False).ids
    assert ids[0] == 151644 and ids.count(151645) == 2 and ids[-2:] == [77091, 198]  # "assistant\n"
    text = chat_prompt([("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")], system="Be brief.")
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert "You are a helpful assistant." in chat_prompt("Hi")


def test_sampling_defaults_come_from_generation_config(tiny_hf_dir):
    s = Sampling.of_model(tiny_hf_dir())  # Qwen2.5's: do_sample, temperature 0.7, top_p 0.8, top_k 20
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert Sampling.of_model(GOLDEN / "tied").temperature == 0  # no do_sample: greedy, like transformers


def test_cli_prompts_files_and_which_model(ms_cpu, tiny_hf_dir, tmp_path, capsys):
    d = tiny_hf_dir(vocab_size=151936, hidden_size=16, intermediate_size=32)
    assert main(["--model-dir", str(d), "--prompt", "Hello", "--prompt", "Hi there", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert len([b for b in out.split("\n\n") if b.strip()]) == 2 and f"the model: {d}" in err and "on CPU" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello", "id": 1}\n{"instruction": "Add", "input": "2+2"}\n'
                       '{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "x"}]}\n')
    assert main(["--model-dir", str(d), "--input", str(prompts), "--output", str(tmp_path / "a.jsonl"),
                 "--max-new-tokens", "2", "--batch-size", "2"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and rows[0]["id"] == 1 and all(isinstance(r["response"], str) for r in rows)
    # the fine-tuned dir is missing: refused unless --base, which says it answers with the base model
    args = ["--finetuned", str(tmp_path / "hf"), "--base-model", str(d), "--prompt", "x", "--max-new-tokens", "1"]
    assert main(args) == 2 and "no fine-tuned model" in capsys.readouterr().err
    assert main([*args, "--base"]) == 0 and "the base model (--base)" in capsys.readouterr().err


def test_cli_checks_options_before_the_model_loads(ms_cpu, tiny_hf_dir, tmp_path, capsys, monkeypatch):
    """issue 19.4: bad sampling options were accepted, --batch-size 0 failed after the model loaded, --output into
    a missing directory failed after generating everything; --base answered with the fine-tuned model."""
    import finetune.generate

    d = tiny_hf_dir()
    monkeypatch.setattr(finetune.generate, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["--model-dir", str(d), "--prompt", "x", "--temperature", "-1", "--top-p", "2", "--top-k", "-3",
                 "--repetition-penalty", "0", "--max-new-tokens", "0", "--batch-size", "0",
                 "--output", str(tmp_path / "missing" / "a.jsonl")]) == 2
    err = capsys.readouterr().err
    for line in ("--temperature=-1.0: must be >= 0 (0: greedy) (e.g. --temperature=0.7)",
                 "--top-p=2.0: must be in (0, 1]",
                 "--top-k=-3", "--repetition-penalty=0.0", "--max-new-tokens=0: must be >= 1", "--batch-size=0",
                 f"its directory {tmp_path / 'missing'} does not exist"):
        assert line in err
    hf = tiny_hf_dir("hf")
    picked = finetune.generate.pick_model(argparse.Namespace(model_dir=None, base=True, base_model=str(d),
                                                             finetuned=str(hf), adapter=None))
    assert picked == (d, "the base model (--base)")  # even though the fine-tuned export exists
    picked = finetune.generate.pick_model(argparse.Namespace(model_dir=None, base=False, base_model=str(d),
                                                             finetuned=str(hf), adapter="adapter"))
    assert picked == (d, "the base model")  # issue 31: an adapter never goes on the (merged) fine-tuned export


def test_cli_refuses_a_model_of_another_family_before_building(ms_cpu, tmp_path, capsys):
    """issue 19.4: --model-dir with a Llama config.json answered anyway; now refused, naming what is supported."""
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}))
    assert main(["--model-dir", str(d), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "model_type 'llama' (LlamaForCausalLM) is not supported" in err and "Qwen3ForCausalLM" in err
    assert "Traceback" not in err


def test_cli_checks_weights_before_building(ms_cpu, tiny_hf_dir, capsys, monkeypatch):
    import finetune.model.decoder

    d = tiny_hf_dir()
    (d / "model.safetensors").unlink()
    monkeypatch.setattr(finetune.model.decoder, "DecoderLM", lambda *a, **k: pytest.fail("model built"))
    assert main(["--model-dir", str(d), "--prompt", "x"]) == 2
    assert "no model.safetensors" in capsys.readouterr().err
    assert main(["--model-dir", str(d.parent / "nope"), "--prompt", "x"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_chat_keeps_the_conversation(ms_cpu, tiny_hf_dir, monkeypatch, capsys):
    import finetune.generate as gen

    d = tiny_hf_dir(vocab_size=151936, hidden_size=16, intermediate_size=32)
    said = iter(["Hi", "And then?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _: next(said))
    seen = []
    real = gen.answer
    monkeypatch.setattr(gen, "answer",
                        lambda m, t, convs, *a, **k: seen.append(list(convs[0]["turns"])) or real(m, t, convs, *a, **k))
    assert main(["--model-dir", str(d), "--chat", "--max-new-tokens", "2"]) == 0
    assert [len(t) for t in seen] == [1, 3] and seen[1][0] == ("user", "Hi") and seen[1][1][0] == "assistant"
    assert capsys.readouterr().out.count("assistant> ") == 2


def test_sample_check_answers_the_bundled_prompts_like_generate_on_the_export(ms_cpu, tiny_hf_dir, tmp_path, capsys):
    """The check after training: the in-memory model gives what `generate` gives on the export."""
    from finetune.dist import RankInfo
    from finetune.generate import load_model, sample_check
    from finetune.io.hf_io import export_hf
    from jobspec.config import ExportConfig, Recipe

    src = tiny_hf_dir(vocab_size=151936, hidden_size=16, intermediate_size=32)
    model, _, _ = load_model(src, "cpu")
    hf = export_hf(model, src, tmp_path / "out" / "hf", dtype="fp32")
    recipe = Recipe(output_dir=str(tmp_path / "out"), export=ExportConfig(check_max_new_tokens=3))
    capsys.readouterr()
    out = sample_check(model, hf, recipe, RankInfo(), RunDir(recipe.output_dir).samples)
    said = capsys.readouterr().out.splitlines()  # issue 19.8: the check says what it does before it starts
    assert said[0].startswith("[train] inference check: answering 5 prompts of ") and "5/5 answered" in said[1]
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    bundled = Path(recipe.export.check_prompts)
    assert out == tmp_path / "out" / "samples.jsonl" and len(rows) == 5
    assert rows[3]["prompt"] == "用一句话解释什么是光合作用。" and all(r["response"] for r in rows)
    assert main(["--model-dir", str(hf), "--input", str(Path(__file__).resolve().parents[2] / bundled),
                 "--output", str(tmp_path / "gen.jsonl"), "--max-new-tokens", "3",
                 "--seed", str(recipe.train.seed)]) == 0
    assert [json.loads(x) for x in (tmp_path / "gen.jsonl").read_text(encoding="utf-8").splitlines()] == rows
    assert sample_check(model, hf, Recipe(export=ExportConfig(check_prompts="")), RankInfo(), tmp_path / "s") is None


QWEN3_CHATS = [([("user", "Hi")], ""),  # Qwen3 writes no system block for an empty system prompt, Qwen2.5 does
               ([("user", "7 * 8?"), ("assistant", "<think>\n7 * 8 = 56.\n</think>\n\n56."), ("user", "/ 4?")],
                "Be brief.")]  # an earlier turn's reasoning is dropped


@pytest.mark.parametrize("turns,system", QWEN3_CHATS)
def test_chat_prompt_is_qwen3s_template_for_qwen3(tmp_path, turns, system):
    from jobspec.data.chat_template import model_template, render_hf
    from jobspec.data.template import QWEN3
    from tests.jobspec.data.data_helpers import qwen3_dir

    messages = [{"role": "system", "content": system}] * bool(system) + [{"role": r, "content": c} for r, c in turns]
    hf = render_hf(model_template(qwen3_dir(tmp_path)), messages, add_generation_prompt=True)
    assert chat_prompt(turns, system, QWEN3) == hf
    assert chat_prompt(turns, system) != hf  # Qwen2.5's differs


def test_generate_prompts_a_qwen3_model_with_qwen3s_template(ms_cpu, tmp_path, monkeypatch, capsys):
    """main(): the model directory's family picks the template (here, the empty system prompt's)."""
    import shutil

    from tokenizers import Tokenizer

    import finetune.generate as gen
    from tests.jobspec.data.data_helpers import qwen3_tokenizer_json

    d = tmp_path / "q3"
    shutil.copytree(GOLDEN / "qwen3-untied", d)
    (d / "tokenizer.json").write_text(json.dumps(qwen3_tokenizer_json(), ensure_ascii=False))
    seen = []
    monkeypatch.setattr(gen, "generate", lambda model, ids, stops, s, pad: seen.extend(ids) or [[] for _ in ids])
    assert main(["--model-dir", str(d), "--prompt", "Hi", "--system", ""]) == 0
    text = Tokenizer.from_file(str(d / "tokenizer.json")).decode(seen[0], skip_special_tokens=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("config,why", [("{not json", "Expecting property name"),
                                        ('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}',
                                         "model_type 'llama' (LlamaForCausalLM) is not supported")])
def test_a_config_json_of_no_known_family_is_an_error_naming_it(tmp_path, capsys, config, why):
    from jobspec.data.template import chat_format

    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}: the chat format .* cannot be told from it"):
        chat_format(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["--model-dir", str(tmp_path), "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'config.json'}: the chat format") and why in err
    assert "Traceback" not in err
