"""finetune.run.summary: summary.json, loss.png panels and TensorBoard event files read back by TensorBoard itself."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.run import summary
from jobspec.recipe_load import load_recipe
from jobspec.rundir import RunDir


def records(n: int = 8, with_eval: bool = True, with_mfu: bool = True) -> list[dict]:
    """Records shaped as metrics.jsonl writes them; eval results as their own records."""
    out = []
    for step in range(1, n + 1):
        r = {"step": step, "loss": 5.0 - 0.4 * step + (0.3 if step == 4 else 0.0), "lr": 1e-4 * step / n,
             "grad_norm": 2.0 / step, "tokens_per_s": 1000.0 + step, "elapsed_s": 0.5 * step}
        if with_mfu:
            r.update(mfu=0.30 + 0.01 * step, peak_memory_bytes=2**30 + step)
        out.append(r)
        if with_eval and step % 4 == 0:
            out.append({"step": step, "eval_loss": {4: 3.9, 8: 3.5}[step], "eval_tokens": 512})
    return out


def test_summary_numbers():
    s = summary.summary(records(), tokens=4096, wall_s=12.345, last_checkpoint="/o/checkpoints/step_8",
                       export_path="/o/hf")
    assert (s["steps"], s["tokens"], s["wall_time_s"]) == (8, 4096, 12.35)
    assert s["first_loss"] == pytest.approx(4.6) and s["last_loss"] == pytest.approx(1.8)
    assert (s["min_loss"], s["min_loss_step"]) == (pytest.approx(1.8), 8)
    assert (s["best_eval_loss"], s["best_eval_step"]) == (3.5, 8)
    assert s["mean_mfu"] == pytest.approx(0.345)
    assert s["peak_memory_bytes"] == 2**30 + 8
    assert (s["last_checkpoint"], s["export_path"]) == ("/o/checkpoints/step_8", "/o/hf")
    assert summary.summary(records(), 0, 0.0, peak_memory_bytes=7)["peak_memory_bytes"] == 7


def test_summary_without_eval_or_mfu():
    s = summary.summary(records(with_eval=False, with_mfu=False), 1, 1.0)
    assert s["best_eval_loss"] is None and s["mean_mfu"] is None and s["peak_memory_bytes"] is None
    assert summary.summary([], 0, 0.0)["first_loss"] is None


def test_a_non_finite_loss_leaves_summary_json_strict(tmp_path):
    """A logged step whose loss is NaN or inf (skipped as non-finite) is no summary number: summary.json stays
    strict JSON, its losses the finite ones (issue 31: summary.json holds no NaN)."""
    recs = records(with_eval=False)
    recs[-1]["loss"], recs[2]["loss"], recs[3]["grad_norm"] = float("nan"), float("inf"), float("nan")
    run = RunDir(tmp_path)
    summary.summarize(recs, run, 1, 1.0)
    s = json.loads(run.summary.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
    assert s["last_loss"] == pytest.approx(recs[-2]["loss"]) and s["min_loss_step"] == 7
    assert run.loss_plot.is_file()


def test_smoothing_is_a_debiased_ema():
    assert summary.smooth([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])  # no pull towards 0
    s = summary.smooth([1.0, 0.0], weight=0.5)
    assert s == pytest.approx([1.0, 0.5 * 0.5 / 0.75])


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


@pytest.mark.parametrize("with_eval,with_mfu", [(True, True), (False, False)])
def test_loss_png_has_the_panels(tmp_path, monkeypatch, with_eval, with_mfu):
    import matplotlib.pyplot as plt

    seen = {}
    close = plt.close

    def spy(fig=None):  # look at the figure before it is closed
        seen["titles"] = [fig._suptitle.get_text()] if fig is not None and fig._suptitle else []
        seen["labels"] = sorted(a.get_ylabel() for a in fig.axes)
        seen["lines"] = {a.get_ylabel(): [ln.get_label() for ln in a.get_lines()] for a in fig.axes}
        close(fig)
    monkeypatch.setattr(plt, "close", spy)
    title = "Qwen2.5-7B | TP 2 x DP 4 x PP 1 | recipe qwen2.5-7b-full | run sft"
    summary.plot(records(with_eval=with_eval, with_mfu=with_mfu), tmp_path / "loss.png", title)
    assert _png_size(tmp_path / "loss.png") == (1100, 700)
    assert seen["titles"] == [title]
    expected = ["grad norm", "learning rate", "loss", "tokens/s"] + (["MFU %"] if with_mfu else [])
    assert seen["labels"] == sorted(expected)
    assert seen["lines"]["loss"][:2] == ["train (raw)", "train (EMA 0.9)"]
    assert ("eval" in seen["lines"]["loss"]) == with_eval


def test_run_title_names_model_layout_and_run(tmp_path):
    r = load_recipe("tiny-cpu", {"model.dir": "/models/Qwen2.5-7B-Instruct", "output_dir": str(tmp_path / "sft-1")})
    assert summary.run_title(r, 2, 4, 1) == "Qwen2.5-7B-Instruct | TP 2 x DP 4 x PP 1 | recipe tiny-cpu | run sft-1"


def test_scalar_tags():
    tags = summary.scalars({"step": 3, "loss": 1.0, "eval_loss": 2.0, "mfu": 0.4, "elapsed_s": 9.0, "data_s": 0.1,
                           "stopped": True, "note": "x"})
    assert tags == {"train/loss": 1.0, "eval/loss": 2.0, "perf/mfu": 0.4, "train/data_s": 0.1}


def _event_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars as TensorBoard's own loader reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir))
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def test_tensorboard_event_file_reads_back(tmp_path):
    recs = records()
    w = summary.RunSummary(RunDir(tmp_path), "t")
    for r in recs:
        w.write(r)
    s = w.close(recs, tokens=100, wall_s=1.0, export_path=str(tmp_path / "hf"))
    got = _event_scalars(tmp_path / "tensorboard")
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "eval/loss",
            "eval/tokens"} <= set(got)
    assert got["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in recs if "loss" in r]
    assert got["eval/loss"] == [(4, pytest.approx(3.9)), (8, pytest.approx(3.5))]
    assert json.loads((tmp_path / "summary.json").read_text()) == s
    assert (tmp_path / "loss.png").is_file()


def test_tensorboard_resume_purges_the_steps_redone(tmp_path):
    recs = records(with_eval=False)
    w = summary.RunSummary(RunDir(tmp_path), "t")
    for r in recs:  # the first run logged steps 1..8, then died; the checkpoint was at step 5
        w.write(r)
    w.close(recs, 1, 1.0)
    w = summary.RunSummary(RunDir(tmp_path), "t", resume_step=5)
    for r in recs[5:]:
        w.write({**r, "loss": r["loss"] + 100})
    w.close(recs, 1, 1.0)
    loss = _event_scalars(tmp_path / "tensorboard")["train/loss"]
    assert [s for s, _ in loss] == list(range(1, 9))
    assert [v > 50 for _, v in loss] == [False] * 5 + [True] * 3


def test_tensorboard_off(tmp_path):
    assert load_recipe("tiny-cpu").train.tensorboard is True
    recipe = load_recipe("tiny-cpu", {"train.tensorboard": "false"})
    w = summary.RunSummary(RunDir(tmp_path), "t", tensorboard=recipe.train.tensorboard)
    w.write(records()[0])
    w.close(records(), 1, 1.0)
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "summary.json").is_file()
