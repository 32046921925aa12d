"""The memory estimate's CPU DP term (``jobspec.memory.host_slot_bytes``) against the RSS that the shared-memory
collectives (finetune/hostcomm.py) add to a member, measured with real processes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobspec.memory import HOST_REGIONS
from launcher.settings import CPU_MALLOC_DEFAULTS

REPO = Path(__file__).resolve().parents[3]
BUCKETS = [3 << 20] * 3  # buckets of 12 MiB in fp32, divisible by 2 and 3 members: more than the regions, which
# every bucket reuses in turn

MEMBER = """
import sys
import numpy as np
from finetune.hostcomm import HostGroup
from jobspec.memory import HOST_REGIONS, host_slot_bytes
prefix, members, index, sharded = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
buckets = {buckets}


def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) * 1024


g = HostGroup(prefix, members, index, timeout_s=60)
grads = [np.random.default_rng([index, k]).standard_normal(n, dtype=np.float32) for k, n in enumerate(buckets)]
chunks = [np.ones(n // members, np.float32) for n in buckets]
before = rss()
sums = g.slots(buckets)
gathers = g.slots([n // members for n in buckets]) if sharded else None
for step in range(2):
    for k, n in enumerate(buckets):
        c = n // members
        lo, hi = (index * c, (index + 1) * c) if sharded else (0, n)
        sums.post(k, [grads[k]], (lo, hi) if sharded else None)  # as HostChannel.reduce_scatter / sum
        if k >= {ahead}:  # the sum of the bucket posted {ahead} before (ZeRO-2/3: IN_FLIGHT_BUCKETS)
            j = k - {ahead}
            sums.sum(j, *((index * (buckets[j] // members), (index + 1) * (buckets[j] // members)) if sharded
                         else (0, buckets[j])))
        if sharded:  # as HostChannel.gather_into: every member's chunk read
            gathers.post(k, [chunks[k]])
            assert sum(float(v.sum()) for v in gathers.views(k)) == n
            gathers.done(k)
    for j in range(len(buckets) - {ahead}, len(buckets)):
        c = buckets[j] // members
        sums.sum(j, *((index * c, (index + 1) * c) if sharded else (0, buckets[j])))
print(rss() - before, host_slot_bytes(max(buckets), members, sharded, 4))
"""


@pytest.mark.parametrize("members,sharded", [(2, False), (2, True), (3, False), (3, True)])
def test_the_shared_memory_term_is_what_a_member_holds(tmp_path, members, sharded):
    """Unsharded a member touches its regions and every peer's whole; sharded, the part of its own regions and
    the peers' chunks it touches, its kept chunks, and the gather's chunks: within 3% of the pages its RSS grew by
    over two steps of more buckets than regions, each summed ``HOST_REGIONS`` posts later as ZeRO-2/3 do (a page
    mapped by several members counts in each one's RSS; the sums, new arrays, are gone)."""
    script = MEMBER.format(buckets=BUCKETS, ahead=HOST_REGIONS)
    env = {**os.environ, **CPU_MALLOC_DEFAULTS}  # the workers' malloc: a freed sum goes back at once
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "grp"), str(members), str(m),
                               "1" if sharded else "0"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for m in range(members)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        grew, estimate = (int(x) for x in out.split())
        assert abs(grew / estimate - 1) < 0.03, (grew, estimate)


def test_the_estimate_counts_the_regions_on_cpu_and_the_sums_as_totals():
    """CPU DP: the regions (of the largest bucket: here the whole model) are the collectives term, the sums the
    totals, as on the NPU, where the collectives are one bucket in flight."""
    from jobspec.memory import BUCKET_BYTES, estimate_memory, host_slot_bytes, shard_elements

    cfg = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
    base = dict(seq_len=128, micro_batch_size=1, dp=2, precision="fp32", recompute=False)
    one = estimate_memory(cfg, **{**base, "dp": 1}, device="cpu")
    trained = one.optimizer // 8
    assert trained * 4 < BUCKET_BYTES
    for sharded in (False, True):
        cpu = estimate_memory(cfg, **base, shard_optimizer=sharded, device="cpu")
        state = shard_elements(trained, 2) if sharded else trained
        assert cpu.totals == state * 4 and cpu.collectives == host_slot_bytes(trained, 2, sharded, 4)
        npu = estimate_memory(cfg, **base, shard_optimizer=sharded, device="npu")
        assert npu.totals == state * 4 and npu.collectives == min(trained * 4, BUCKET_BYTES)
