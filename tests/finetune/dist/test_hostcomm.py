"""Host collectives through shared memory (finetune/hostcomm.py), with real processes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
LENGTHS = [5, 300_001, 7]  # a bucket of each kind: tiny, large, odd
ROUNDS = 3

MEMBER = """
import sys, time
import numpy as np
from finetune.hostcomm import HostGroup
prefix, members, index, out, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
g = HostGroup(prefix, members, index, timeout_s=float(sys.argv[6]))
if mode == "die" and index == members - 1:
    sys.exit(3)
grads = g.slots({lengths})
weights = g.slots([4, 6], np.float16)
chunks = g.slots([3 * 1001])  # a reduce-scatter: each member keeps its own chunk out of the region
for r in range({rounds}):
    for k, n in enumerate({lengths}):
        grads.post(k, [np.random.default_rng([index, r, k]).standard_normal(n, dtype=np.float32)])
    late = mode == "slow" and index == 1 and r == 0  # reads its sums after the weights, and late
    sums = [] if late else [grads.sum(k, 1, None) for k in range(len({lengths}))]
    weights.post(0, [np.full(3, index + r, np.float16)])  # padded with a zero
    weights.post(1, [np.arange(2, dtype=np.float16) * index, np.arange(2, 6, dtype=np.float16) * index])
    got = [np.concatenate(weights.views(k)) for k in (0, 1)]
    weights.done(0), weights.done(1)
    np.save(f"{{out}}/gather-{{index}}-{{r}}.npy", np.concatenate(got))
    if late:
        time.sleep(0.5)  # the others post their next round's gradients meanwhile
        sums = [grads.sum(k, 1, None) for k in range(len({lengths}))]
    for k, s in enumerate(sums):
        np.save(f"{{out}}/sum-{{index}}-{{r}}-{{k}}.npy", s)
    x = np.random.default_rng([index, r, 9]).standard_normal(2900, dtype=np.float32)
    chunks.post(0, [x[:1500], x[1500:]], keep=(index * 1001, (index + 1) * 1001))  # padded to 3003
    np.save(f"{{out}}/chunk-{{index}}-{{r}}.npy", chunks.sum(0, index * 1001, (index + 1) * 1001))
"""


def run_members(tmp_path: Path, members: int, mode: str, timeout_s: float = 60.0) -> list[subprocess.CompletedProcess]:
    script = MEMBER.format(lengths=LENGTHS, rounds=ROUNDS)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "grp"), str(members), str(m),
                               str(tmp_path), mode, str(timeout_s)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for m in range(members)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.parametrize("mode", ["even", "slow"])
def test_members_get_the_same_sums_and_gathers_in_member_order(tmp_path, mode):
    """Three members, three rounds; with ``slow`` one member reads its first round late while the others
    post the next one: no region is written again before every member has read it."""
    done = run_members(tmp_path, 3, mode)
    assert [p.returncode for p in done] == [0, 0, 0], [p.stderr[-2000:] for p in done]
    for r in range(ROUNDS):
        for k, n in enumerate(LENGTHS):
            parts = [np.random.default_rng([m, r, k]).standard_normal(n, dtype=np.float32)[1:] for m in range(3)]
            want = (parts[0] + parts[1]) + parts[2]
            for m in range(3):
                np.testing.assert_array_equal(np.load(tmp_path / f"sum-{m}-{r}-{k}.npy"), want)
        want_g = np.concatenate([np.concatenate([np.full(3, m + r).tolist() + [0] for m in range(3)]),
                                 np.concatenate([np.arange(6) * m for m in range(3)])]).astype(np.float16)
        for m in range(3):
            np.testing.assert_array_equal(np.load(tmp_path / f"gather-{m}-{r}.npy"), want_g)
        xs = [np.pad(np.random.default_rng([m, r, 9]).standard_normal(2900, dtype=np.float32), (0, 103))
              for m in range(3)]
        for m in range(3):
            np.testing.assert_array_equal(np.load(tmp_path / f"chunk-{m}-{r}.npy"),
                                          ((xs[0] + xs[1]) + xs[2])[m * 1001:(m + 1) * 1001])
    assert not list(tmp_path.glob("grp*")), "the shared files and FIFOs are unlinked once every member has them"


def test_a_member_that_dies_is_named_by_the_others(tmp_path):
    done = run_members(tmp_path, 3, "die", timeout_s=3.0)
    assert done[2].returncode == 3
    for p in done[:2]:
        assert p.returncode != 0
        assert "no word from member(s) [2]" in p.stderr, p.stderr[-2000:]
