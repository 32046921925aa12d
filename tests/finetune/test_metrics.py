"""metrics.jsonl on resume: exactly the records up to the checkpoint's step; a restart keeps the old history."""
import json

from finetune.run.metrics import MetricsWriter, read_metrics


def _write(path, steps, tail=""):
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps) + tail)


def test_resume_drops_a_partial_last_line_and_later_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [1, 2, 3, 4, 5], tail='{"step": 6, "lo')  # a crash or full disk during the append
    w = MetricsWriter(path, resume_step=4)
    assert [r["step"] for r in w.records] == [1, 2, 3, 4]
    w.write({"step": 5, "loss": 0.5})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    assert path.read_text().count("\n") == 5 and path.read_text().endswith("}\n")


def test_starting_over_keeps_the_old_history_and_says_so(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [1, 2, 3])
    said = []
    w = MetricsWriter(path, resume_step=0, say=said.append)
    assert w.records == [] and path.read_text() == ""
    kept = [p for p in tmp_path.glob("metrics.*.jsonl")]
    assert len(kept) == 1 and [r["step"] for r in read_metrics(kept[0])] == [1, 2, 3]
    assert len(said) == 1 and "3 earlier metrics records (to step 3)" in said[0] and str(kept[0]) in said[0]
