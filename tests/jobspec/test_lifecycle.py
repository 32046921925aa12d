"""issue 19.6: a worker's error is one line on the console; its traceback is in the file that line names."""
import json

from jobspec.lifecycle import run_rank


def test_a_failing_rank_prints_one_line_and_keeps_the_traceback_in_its_status_file(tmp_path, capsys):
    def main():
        raise ValueError("the data gives no full global batch")

    assert run_rank(tmp_path / "logs", 3, main) == 1
    err = capsys.readouterr().err
    path = tmp_path / "logs" / "ranks" / "rank_00003.json"
    assert err == f"[rank 3] error: ValueError: the data gives no full global batch (traceback in {path})\n"
    record = json.loads(path.read_text())
    assert record["exit_code"] == 1 and "Traceback" in record["error"]["traceback"]
    assert 'raise ValueError("the data gives no full global batch")' in record["error"]["traceback"]
