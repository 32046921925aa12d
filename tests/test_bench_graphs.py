"""`make bench-graphs` (tools/bench_graphs.py): per layer from two depths, the fit, the table."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))


def load_bench():
    import bench_graphs

    return bench_graphs


def test_per_layer_is_the_difference_of_two_depths_over_their_layers_at_the_pass_asked():
    bench = load_bench()
    peaks = {(2, True): [100, 120, 130], (4, True): [300, 330, 350], (2, False): [50, 50, 60], (4, False): [70, 72, 80]}
    assert bench.LAYERS == (2, 4)
    assert bench.per_layer(peaks) == (110, 10) and bench.per_layer(peaks, 0) == (100, 10)


def test_the_fit_recovers_known_coefficients_from_full_rows_and_ignores_lora_rows():
    bench = load_bench()
    coef = [16 * 2**20, 1.3, 479.0, 45.0]
    rows = [{"hidden": h, "micro_batch": mb, "seq": s, "lora": False, "graphs": bench.predict(coef, h, mb, s)}
            for h, mb, s, lora in bench.SHAPES if not lora]
    rows.append({"hidden": 512, "micro_batch": 2, "seq": 256, "lora": True, "graphs": 1e12})
    assert bench.fit(rows) == pytest.approx(coef, rel=1e-6)


def test_the_features_are_the_layers_weights_tokens_x_hidden_and_the_scores():
    bench = load_bench()
    from jobspec.memory import layer_weight_elements

    one, weights, th, scores = bench.features(512, 2, 256)
    assert (one, th, scores) == (1.0, 512 * 512, 512 * 8 * 256)
    # q, k, v (with biases), o, gate, up, down, two norms
    assert weights == 4 * layer_weight_elements(bench.model_config(512, 1)) == 4 * 2_819_840


def test_the_table_compares_each_row_with_the_estimates_term():
    bench = load_bench()
    from jobspec.memory import graph_bytes

    est = graph_bytes(bench.model_config(512, 1), 512, 256)
    row = {"hidden": 512, "micro_batch": 2, "seq": 256, "lora": False, "compiled": 222 * 2**20,
           "op_by_op": 28 * 2**20, "graphs": est, "graphs_first": 180 * 2**20}
    text = bench.table([row], [1.0, 2.0, 3.0, 4.0])
    assert f"| 512 | 2 | 256 | full | 222 | 28 | 180 | {est / 2**20:.0f} | {est / 2**20:.0f} | 1.00 |" in text
    assert "fit: a (bytes) 1" in text
