"""issue 22 §2: one RunDir; the README's output table is generated from it."""
from pathlib import Path

from jobspec.config import REPO_ROOT, load_recipe, resolved_model_dir
from jobspec.data.cache import cache_dir_for
from jobspec.lifecycle import log_dir
from jobspec.rundir import ENTRIES, RunDir, is_complete, readme_table


def test_the_readme_table_is_the_rundirs():
    assert readme_table() in (REPO_ROOT / "README.md").read_text()


def test_every_entry_is_a_path_and_the_project_uses_them(tmp_path):
    run = RunDir(tmp_path)
    for attr, rel, _ in ENTRIES:
        path = run.npu_log() if attr == "npu_log" else getattr(run, attr)
        assert path == tmp_path / rel.split("/")[0]
    assert run.checkpoint(30) == tmp_path / "checkpoints" / "step_00000030"
    assert run.export(run.checkpoint(30)) == tmp_path / "hf-step_00000030"
    recipe = load_recipe("tiny-cpu", {"output_dir": str(tmp_path)})
    assert Path(resolved_model_dir(recipe)) == run.base_model and cache_dir_for(recipe) == run.data
    assert log_dir(tmp_path) == run.logs


def test_a_checkpoint_is_complete_with_its_manifest_and_not_as_tmp(tmp_path):
    done, tmp = tmp_path / "step_00000001", tmp_path / "step_00000002.tmp"
    for d in (done, tmp):
        d.mkdir()
        (d / "manifest.json").write_text("{}")
    assert is_complete(done) and not is_complete(tmp) and not is_complete(tmp_path / "step_00000003")
