"""Real datasets in: format detection per file, plain text, field mapping, malformed records, report."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jobspec.config import ConfigError
from jobspec.data.encode import load_tokenizer
from jobspec.data.files import DataError
from jobspec.data.formats import iter_samples
from jobspec.data.prepare import prepare
from jobspec.data.report import format_report
from jobspec.data.template import IGNORE
from jobspec.finish import finished
from jobspec.recipe_load import load_recipe
from tests.jobspec.data.data_helpers import TOKENIZER, alpaca, cache_of, recipe_for, write_json, write_jsonl

CONV = {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "2+2 is 4."}]}


def _arrays(info):
    return {n: np.load(info.dir / f"{n}.npy") for n in ("tokens", "labels", "index")}


def test_each_file_detected_and_logged_with_its_reason(tmp_path, capsys):
    a = write_json(tmp_path / "a.json", [alpaca(i) for i in range(6)])
    s = write_jsonl(tmp_path / "s.jsonl", [CONV])
    t = write_jsonl(tmp_path / "t.jsonl", [{"text": "A plain document about apples and pears."}])
    info = prepare(*cache_of(recipe_for(tmp_path, [a, s, t])), progress=True)
    err = capsys.readouterr().err
    assert f"{a}: alpaca (records have `instruction`; detected" in err
    assert f"{s}: sharegpt (records have `conversations`; detected" in err
    assert f"{t}: text (records have `text`; detected" in err
    assert [x["format"] for x in info.report["sources"]] == ["alpaca", "sharegpt", "text"]


def test_a_file_of_another_format_than_the_one_set_is_named(tmp_path):
    s = write_jsonl(tmp_path / "s.jsonl", [CONV])
    with pytest.raises(DataError, match=r"s.jsonl:line 1: looks like ShareGPT \(records have `conversations`\), "
                                        r"but data.format is alpaca; set DATA_FORMAT=sharegpt"):
        prepare(*cache_of(recipe_for(tmp_path, [s], format="alpaca")), progress=False)
    a = write_json(tmp_path / "a.json", [alpaca(0)])
    with pytest.raises(DataError, match=r"looks like Alpaca .*set DATA_FORMAT=alpaca"):
        list(iter_samples(a, "sharegpt"))
    assert not (tmp_path / "out").exists()


def test_plain_text_documents_end_with_eos_learn_every_token_and_long_ones_split(tmp_path):
    tok = load_tokenizer(str(TOKENIZER), TOKENIZER.stat().st_mtime)
    long = " ".join(f"Sentence number {i} of a long document." for i in range(40))
    short = "A short note."
    t = write_jsonl(tmp_path / "t.jsonl", [{"text": short}, {"text": long}])
    (tmp_path / "book.txt").write_text("Chapter one.\n\nIt was a bright cold day in April.\n")
    info = prepare(*cache_of(recipe_for(tmp_path, [t, tmp_path / "book.txt"], seq_len="64")), progress=False)
    arr = _arrays(info)
    eos = tok.token_to_id("<|endoftext|>")
    want = [tok.encode(x, add_special_tokens=False).ids + [eos]
            for x in (short, long, "Chapter one.\n\nIt was a bright cold day in April.\n")]
    assert arr["tokens"].tolist() == sum(want, [])  # nothing templated, nothing lost
    assert (arr["labels"] == arr["tokens"]).all()  # loss on every token
    lengths = arr["index"][:, 1].tolist()
    n_long = len(want[1])
    assert lengths == [len(want[0])] + [64] * (n_long // 64) + [n_long % 64] + [len(want[2])]
    assert info.report["split_documents"] == 1 and info.report["dropped"] == {}
    assert info.report["label_tokens"] == int(arr["index"][:, 2].sum() + arr["index"][:, 3].sum())


def test_data_columns_map_other_field_names(tmp_path):
    own = write_jsonl(tmp_path / "qa.jsonl", [{"question": a["instruction"], "answer": a["output"]}
                                              for a in map(alpaca, range(5))])
    ref = write_jsonl(tmp_path / "a.jsonl", [alpaca(i) for i in range(5)])
    with pytest.raises(DataError, match=r"""data.columns='\{"instruction": "question", "output": "answer"\}'"""):
        prepare(*cache_of(recipe_for(tmp_path / "x", [own])), progress=False)
    columns = '{"instruction": "question", "output": "answer"}'
    mapped = prepare(*cache_of(recipe_for(tmp_path / "m", [own], columns=columns)), progress=False)
    plain = prepare(*cache_of(recipe_for(tmp_path / "p", [ref])), progress=False)
    for name in ("tokens", "labels", "index"):
        assert np.array_equal(_arrays(mapped)[name], _arrays(plain)[name]), name
    chats = write_jsonl(tmp_path / "d.jsonl", [{"dialog": [{"speaker": "user", "says": "hi"},
                                                           {"speaker": "assistant", "says": "hello"}]}])
    (s,) = iter_samples(chats, columns={"messages": "dialog", "role": "speaker", "content": "says"})
    assert s.turns == (("user", "hi"), ("assistant", "hello"))


def test_on_error_skip_counts_malformed_records_and_fail_stops(tmp_path):
    p = tmp_path / "m.jsonl"
    lines = [json.dumps(alpaca(i)) for i in range(4)]
    lines[1] = '{"instruction": "x", "output": '  # cut off
    lines[2] = json.dumps({"instruction": "no answer"})
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"m.jsonl: line 2 .*not valid JSON"):
        prepare(*cache_of(recipe_for(tmp_path, [p])), progress=False)
    info = prepare(*cache_of(recipe_for(tmp_path, [p], on_error="skip")), progress=False)
    assert info.num_samples == 2
    bad = info.report["dropped"]["malformed"]
    assert bad["count"] == 2
    assert "m.jsonl: line 2" in bad["examples"][0]["error"] and "'output' is missing" in bad["examples"][1]["error"]
    assert "malformed" in format_report(info.report)


def test_report_explains_itself(tmp_path):
    long = alpaca(7, out="word " * 200)  # the answer alone is longer than seq_len
    dangling = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "an answer"},
                             {"role": "user", "content": "and then?"}]}
    a = write_json(tmp_path / "a.json", [alpaca(i) for i in range(5)] + [long])
    m = write_jsonl(tmp_path / "m.jsonl", [dangling])
    info = prepare(*cache_of(recipe_for(tmp_path, [a, m], seq_len="64")), progress=False)
    rep = info.report
    ex = rep["dropped"]["cannot_fit"]["examples"][0]
    assert ex["where"].endswith("a.json[5]") and ex["tokens"] > 200
    assert rep["ended_on_user"]["count"] == 1 and rep["ended_on_user"]["examples"][0]["turns_dropped"] == 1
    labels = np.load(info.dir / "labels.npy")
    idx = np.load(info.dir / "index.npy")
    assert rep["label_tokens"] == int((labels != IGNORE).sum()) == int(idx[:, 2].sum() + idx[:, 3].sum())
    for figure in ("samples_read", "samples_kept", "index_entries", "tokens", "label_tokens", "truncated",
                   "ended_on_user", "efficiency.packing", "efficiency.padding", "dropped.cannot_fit"):
        assert rep["meaning"][figure], figure
    table = format_report(rep)
    assert f"({ex['tokens']:d} tokens)" in table
    assert rep["meaning"]["efficiency.padding"] in table and rep["meaning"]["label_tokens"] in table
    assert rep["meaning"]["ended_on_user"] in table


def test_the_embedded_default_keeps_its_samples(tmp_path):
    r = finished(load_recipe("tiny-cpu", {"output_dir": str(tmp_path)}))
    rep = prepare(*cache_of(r), progress=False).report
    assert rep["dropped"].get("cannot_fit", {"count": 0})["count"] / rep["samples_read"] < 0.01


def test_new_data_settings_are_validated():
    with pytest.raises(ConfigError) as e:
        load_recipe(raw={"model": {"init": {}}}, overrides={
            "data.columns": '{"instrucion": "q"}', "data.on_error": "ignore", "data.val_size": "2.5",
            "data.format": "csv"})
    text = str(e.value)
    assert "data.columns: unknown field 'instrucion' (did you mean 'instruction'?)" in text
    assert "data.on_error='ignore'" in text and "data.val_size=2.5" in text and "text" in text
    with pytest.raises(ConfigError, match="data.val_size and data.val_paths both set"):
        load_recipe(raw={"model": {"init": {}}}, overrides={"data.val_size": "0.1", "data.val_paths": "v.json"})
