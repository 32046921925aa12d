"""The suite's own disk hygiene: what a full `make test` leaves on disk before the image build."""
from __future__ import annotations

import json
from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

# Each inner module writes 1 MB into its module_tmp and records the path.
MODULE = """
import json, os
from pathlib import Path

def test_writes(module_tmp):
    (module_tmp / "blob").write_bytes(bytes(1 << 20))
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps([__name__, str(module_tmp)]) + "\\n")

def test_then(module_tmp):
    assert {FAIL}
"""


def test_module_tmp_is_removed_after_a_passing_module_and_kept_after_a_failing_one(pytester, tmp_path,
                                                                                   monkeypatch) -> None:
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("RECORD", str(record))
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_passes=MODULE.replace("{FAIL}", "True"),
                        test_fails=MODULE.replace("{FAIL}", "False, 'kept for the post-mortem'"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--basetemp", str(tmp_path / "base"))
    result.assert_outcomes(passed=3, failed=1)
    dirs = dict(json.loads(line) for line in record.read_text().splitlines())
    assert set(dirs) == {"test_passes", "test_fails"}
    assert not Path(dirs["test_passes"]).exists()
    assert (Path(dirs["test_fails"]) / "blob").stat().st_size == 1 << 20


def test_the_suite_keeps_only_the_tmp_paths_of_failed_tests(request) -> None:
    assert request.config.getini("tmp_path_retention_policy") == "failed"
