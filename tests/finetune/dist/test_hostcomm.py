"""Host collectives through shared memory (finetune/hostcomm.py), with real processes."""
from __future__ import annotations

import itertools
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
regions = int(sys.argv[7])  # of the gradients' slots: fewer than their buckets, which are all posted before a sum
g = HostGroup(prefix, members, index, timeout_s=float(sys.argv[6]))
if mode in ("die", "hang") and index == members - 1:
    if mode == "hang":
        time.sleep(60)
    sys.exit(3)
if mode == "die":
    time.sleep(1.0)  # the last member has ended by now: the first message to it finds no reader
grads = g.slots({lengths}, regions=regions)
weights = g.slots([4, 6], np.float16)
chunks = g.slots([3 * 1001, 3 * 1001], regions=regions)  # a reduce-scatter: each member keeps its own chunk out of the region
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
    for k in (0, 1):  # bucket 1 reuses bucket 0's region with one region: its kept chunk taken before
        chunks.post(k, [x[:1500], x[1500:] * (k + 1)], keep=(index * 1001, (index + 1) * 1001))  # padded to 3003
    for k in (0, 1):
        np.save(f"{{out}}/chunk-{{index}}-{{r}}-{{k}}.npy", chunks.sum(k, index * 1001, (index + 1) * 1001))
"""


def run_members(tmp_path: Path, members: int, mode: str, timeout_s: float = 60.0,
                until: int | None = None, regions: int = 2) -> list[subprocess.CompletedProcess]:
    """Every member's result; members from ``until`` on are killed once the others have ended."""
    script = MEMBER.format(lengths=LENGTHS, rounds=ROUNDS)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "grp"), str(members), str(m),
                               str(tmp_path), mode, str(timeout_s), str(regions)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for m in range(members)]
    out = []
    for p in procs[:until]:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    for p in procs[until:]:
        p.kill()
        p.communicate()
    return out


@pytest.mark.parametrize("mode", ["even", "slow"])
@pytest.mark.parametrize("regions", [1, 2])
def test_members_get_the_same_sums_and_gathers_in_member_order(tmp_path, mode, regions):
    """Three members, three rounds, each posting its three gradient buckets into ``regions`` reused regions before
    it sums any (a post over a bucket not summed yet sums it first); with ``slow`` one member reads its first round
    late while the others run ahead into the next one: no region is written again before every member has read
    it."""
    done = run_members(tmp_path, 3, mode, regions=regions)
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
        for m, k in itertools.product(range(3), (0, 1)):
            ys = [np.concatenate([x[:1500], x[1500:] * (k + 1)]) for x in xs]
            np.testing.assert_array_equal(np.load(tmp_path / f"chunk-{m}-{r}-{k}.npy"),
                                          ((ys[0] + ys[1]) + ys[2])[m * 1001:(m + 1) * 1001])
    assert not list(tmp_path.glob("grp*")), "the shared files and FIFOs are unlinked once every member has them"


def test_a_member_that_hangs_is_named_by_the_others(tmp_path):
    done = run_members(tmp_path, 3, "hang", timeout_s=3.0, until=2)
    for p in done[:2]:
        assert p.returncode != 0
        assert "no word from member(s) [2]" in p.stderr, p.stderr[-2000:]


def test_a_member_that_dies_is_named_at_once_as_a_lost_peer(tmp_path):
    """A FIFO without its reader: the next message fails at once (no wait for the timeout) with PeerLost,
    which the launcher names after the dead member itself (jobspec.lifecycle)."""
    done = run_members(tmp_path, 3, "die", timeout_s=60.0)
    assert done[2].returncode == 3
    for p in done[:2]:
        assert p.returncode != 0
        assert "PeerLost: host collectives: member 2 of" in p.stderr and "is gone" in p.stderr, p.stderr[-2000:]
