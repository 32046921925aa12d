"""Readers: Alpaca/ShareGPT in JSON, JSONL, Parquet; weights; errors naming file, record, field."""
from __future__ import annotations

import json

import pytest

from jobspec.config import DataConfig
from jobspec.data.formats import DataError, check_data, iter_samples, resolve_sources
from tests.jobspec.data.data_helpers import alpaca, write_json, write_jsonl


def _parquet(path, columns: dict):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # pyarrow>=22 with numpy<2 in a stale venv: `make setup` fixes it
        pytest.skip(f"pyarrow unusable here: {e}")
    pq.write_table(pa.table(columns), path)
    return path


def test_alpaca_json_with_system_history_and_input(tmp_path):
    rec = {"instruction": "Add", "input": "1 and 2", "output": "3", "system": "Be terse.",
           "history": [["hi", "hello"]]}
    (s,) = iter_samples(write_json(tmp_path / "a.json", [rec]))
    assert s.system == "Be terse."
    assert s.turns == (("user", "hi"), ("assistant", "hello"), ("user", "Add\n1 and 2"), ("assistant", "3"))
    assert s.where.endswith("a.json[0]")


def test_sharegpt_both_shapes_and_auto_detection_per_file(tmp_path):
    conv = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q"},
                              {"from": "gpt", "value": "a"}]}
    msgs = {"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
                         {"role": "user", "content": "dangling"}]}
    (s1,) = iter_samples(write_jsonl(tmp_path / "c.jsonl", [conv]))
    (s2,) = iter_samples(write_json(tmp_path / "m.json", [msgs]))
    assert s1.system == "S" and s1.turns == (("user", "q"), ("assistant", "a"))
    assert s2.system is None and s2.turns == (("user", "q2"), ("assistant", "a2"))  # trailing user dropped
    assert s1.where.endswith("c.jsonl:line 1")


def test_parquet_alpaca_and_sharegpt(tmp_path):
    p = _parquet(tmp_path / "a.parquet", {"instruction": ["i0", "i1"], "input": ["", "x"], "output": ["o0", "o1"]})
    assert [s.turns[-2][1] for s in iter_samples(p)] == ["i0", "i1\nx"]
    q = _parquet(tmp_path / "s.parquet", {"conversations": [[{"from": "human", "value": "q"},
                                                             {"from": "gpt", "value": "a"}]]})
    assert next(iter_samples(q)).turns == (("user", "q"), ("assistant", "a"))


def test_directories_sorted_weights_and_repo_relative_paths(tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    write_json(d / "b.json", [alpaca(1)])
    write_jsonl(d / "a.jsonl", [alpaca(2)])
    (d / "notes.txt").write_text("ignored")
    srcs = resolve_sources(DataConfig(paths=[str(d), "assets/data/alpaca_en_300.json"], weights=[2, 0.5]))
    assert [s.path.name for s in srcs] == ["a.jsonl", "b.json", "alpaca_en_300.json"]
    assert [s.weight for s in srcs] == [2.0, 2.0, 0.5]


@pytest.mark.parametrize("name,content,expect", [
    ("missing.json", [{"instruction": "x", "input": ""}], ["missing.json[0]", "'output'", "missing"]),
    ("type.json", [alpaca(0), {"instruction": "x", "output": 5}], ["type.json[1]", "'output'", "string"]),
    ("role.jsonl", [{"conversations": [{"from": "robot", "value": "x"}]}],
     ["role.jsonl:line 1", "conversations[0].from", "'robot'", "human"]),
    ("unknown.json", [{"question": "x", "answer": "y"}],
     ["unknown.json[0]", "unknown format", """data.columns='{"instruction": "question", "output": "answer"}'"""]),
    ("empty.json", [], ["empty.json", "no records"]),
])
def test_bad_records_name_file_record_field(tmp_path, name, content, expect):
    path = (write_jsonl if name.endswith("jsonl") else write_json)(tmp_path / name, content)
    with pytest.raises(DataError) as e:
        list(iter_samples(path))
    for part in expect:
        assert part in str(e.value)
    assert check_data(DataConfig(paths=[str(path)])) == [str(e.value)]


def test_malformed_json_line_names_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(alpaca(0)) + "\n\n" + '{"instruction": "x", "output": }\n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 3 .*not valid JSON"):
        list(iter_samples(p))


def test_truncated_json_array_names_the_record(tmp_path):
    p = tmp_path / "cut.json"
    p.write_text(json.dumps([alpaca(0), alpaca(1), alpaca(2)])[:-30])
    with pytest.raises(DataError, match=r"cut.json: record 2 .*truncated"):
        list(iter_samples(p))


def test_parquet_with_other_column_names_is_read_through_data_columns(tmp_path):
    p = _parquet(tmp_path / "cols.parquet", {"prompt": ["x"], "completion": ["y"]})
    with pytest.raises(DataError, match=r"cols.parquet\[0\]: unknown format \(record has \['completion', 'prompt'\]\)"
                                        r""".*data.columns='\{"instruction": "prompt", "output": "completion"\}'"""):
        list(iter_samples(p))
    (s,) = iter_samples(p, columns={"instruction": "prompt", "output": "completion"})
    assert s.turns == (("user", "x"), ("assistant", "y"))


def test_unknown_extension_and_missing_path(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    probs = check_data(DataConfig(paths=[str(tmp_path / "d.csv")]))
    assert len(probs) == 1 and "d.csv" in probs[0] and ".jsonl" in probs[0]
    probs = check_data(DataConfig(paths=[str(tmp_path / "nope.json")]))
    assert "nope.json" in probs[0] and "data.paths[0]" in probs[0]
    assert "data.paths is empty" in check_data(DataConfig())[0]


def test_check_data_fine_on_bundled_data():
    assert check_data(DataConfig(paths=["assets/data"])) == []
