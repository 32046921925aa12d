"""DP sums and gathers for CPU workers on one host, through shared memory instead of MindSpore's CPU
collectives.

MindSpore's CPU collectives move about 0.2 GB/s on the 2-core machine (docs/speed.md): DP's gradient and
weight traffic then costs more than the second core gains. Workers on one host can read each other's
memory instead. Each member of a group maps one file per :class:`Slots` in ``/dev/shm`` (a few regions, each
the size of the largest bucket, reused bucket after bucket: ``jobspec.memory.HOST_REGIONS``), unlinked as soon
as every member has it mapped, so nothing is left behind whatever happens to the job. A member copies its
bucket into its own region and tells the others; each reads every member's region and adds them in member
order, so every member gets the same bits (and two members, the bits of MindSpore's sum, ``a + b``). Messages
go through one FIFO per member: ``write``/``read`` on a pipe order the memory writes before them (the kernel's
pipe lock), on x86 and on Arm alike, and a member waiting for a message sleeps in ``select`` instead of
spinning on a core a peer needs.

A region is written again only after every member has said it is done reading its previous post (``done``
messages, counted per region), so a member running ahead cannot overwrite a bucket a slower one still reads.
Every member must make the same calls in the same order, as with any collective. Pure numpy: tested with plain
processes (tests/finetune/dist/test_hostcomm.py), used by the workers when the plan says so
(``layout.host_collectives``).
"""
from __future__ import annotations

import errno
import mmap
import os
import select
import struct
import time

import numpy as np

from jobspec.lifecycle import PeerLost
from jobspec.memory import HOST_REGIONS

MSG = struct.Struct("<BHHII")  # kind, sender, slots id, region, generation
HELLO, CREATED, READY, DONE = 1, 2, 3, 4


class HostGroup:
    """``members`` processes on this host that talk through files named ``prefix``-*; this one is ``index``.

    ``prefix`` must be unique to the group and the job (``/dev/shm/af-<token>-dp0``) and identical on every
    member. Opening waits up to ``timeout_s`` for every member; a wait for a message later, too.
    """

    def __init__(self, prefix: str, members: int, index: int, timeout_s: float = 600.0):
        self.prefix, self.members, self.index, self.timeout_s = prefix, members, index, timeout_s
        self.peers = [m for m in range(members) if m != index]
        self.seen: dict[tuple[int, int, int, int], int] = {}  # (kind, slots, bucket, sender) -> newest generation
        self.pending = b""
        self.n_slots = 0
        own = self._fifo(index)
        os.mkfifo(own, 0o600)
        self.inbox = os.open(own, os.O_RDWR)  # read side; never sees EOF, never blocks the open
        self.outbox = {m: self._open_peer(m) for m in self.peers}
        self._all(HELLO, 0, 0, 0)  # every member has opened this FIFO for writing: its name can go
        os.unlink(own)

    def _fifo(self, m: int) -> str:
        return f"{self.prefix}-fifo{m}"

    def _open_peer(self, m: int) -> int:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return os.open(self._fifo(m), os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:  # not made yet (ENOENT), or made but not opened by its reader yet (ENXIO)
                if e.errno not in (errno.ENOENT, errno.ENXIO) or time.monotonic() > deadline:
                    raise RuntimeError(f"host collectives: member {m} of {self.prefix} did not open its FIFO within "
                                       f"{self.timeout_s:.0f} s ({e})") from e
                time.sleep(0.01)

    def send(self, kind: int, slots: int, k: int, gen: int, to: list[int]) -> None:
        msg = MSG.pack(kind, self.index, slots, k, gen)
        for m in to:
            try:
                os.write(self.outbox[m], msg)  # one write of under PIPE_BUF bytes: atomic
            except BrokenPipeError as e:  # the FIFO has no reader: member m's process has ended
                raise PeerLost(f"host collectives: member {m} of {self.prefix} is gone (its process ended); "
                               "this rank cannot go on without it") from e

    def wait(self, kind: int, slots: int, k: int, gen: int) -> None:
        """Until every peer has sent (kind, slots, k) with a generation >= ``gen``."""
        deadline = time.monotonic() + self.timeout_s
        while any(self.seen.get((kind, slots, k, m), -1) < gen for m in self.peers):
            ready, _, _ = select.select([self.inbox], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                late = [m for m in self.peers if self.seen.get((kind, slots, k, m), -1) < gen]
                raise RuntimeError(f"host collectives: no word from member(s) {late} of {self.prefix} in "
                                   f"{self.timeout_s:.0f} s (message {kind}, bucket {k}, generation {gen}); "
                                   "a worker died or hangs: see its log")
            self.pending += os.read(self.inbox, 1 << 16)
            whole = len(self.pending) - len(self.pending) % MSG.size
            for kd, sender, s, kk, g in MSG.iter_unpack(self.pending[:whole]):
                key = (kd, s, kk, sender)
                self.seen[key] = max(g, self.seen.get(key, -1))
            self.pending = self.pending[whole:]

    def _all(self, kind: int, slots: int, k: int, gen: int) -> None:
        """A barrier on (kind, slots, k, gen): tell every peer, hear from every peer."""
        self.send(kind, slots, k, gen, self.peers)
        self.wait(kind, slots, k, gen)

    def slots(self, lengths: list[int], dtype: np.dtype | type = np.float32, regions: int = HOST_REGIONS) -> Slots:
        """``regions`` regions, each the largest bucket of ``lengths`` elements, on every member (a collective
        call)."""
        self.n_slots += 1
        return Slots(self, self.n_slots, lengths, np.dtype(dtype), regions)


class Slots:
    """Every member's ``regions`` regions for a set of buckets: ``post`` this member's bucket, ``view`` the others'.

    Each region holds the largest bucket; the i-th ``post`` goes to region i mod ``regions`` (the same one on every
    member: the same calls in the same order), and a region's generation counts its posts. Posting over a bucket
    whose sum this member has not taken yet takes it first (kept until ``sum`` asks for it), so a member may post
    more buckets than there are regions before it sums any; a bucket whose views are still read must be ``done``
    first."""

    def __init__(self, group: HostGroup, sid: int, lengths: list[int], dtype: np.dtype, regions: int):
        self.group, self.sid, self.lengths, self.dtype = group, sid, list(lengths), dtype
        self.size, self.n = max([1, *self.lengths]), max(1, regions)
        nbytes = self.size * self.n * dtype.itemsize
        mine = self._file(group.index)
        fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)  # no space: an error now, not a SIGBUS at the first write
            except OSError as e:
                os.unlink(mine)
                free = os.statvfs(os.path.dirname(mine))
                raise RuntimeError(f"host collectives: cannot reserve {nbytes / 2**20:.0f} MiB in "
                                   f"{os.path.dirname(mine)} ({free.f_bavail * free.f_frsize / 2**20:.0f} MiB free; "
                                   f"{e.strerror}); give the container more shared memory (docker run --shm-size) "
                                   "or set OVERRIDES='parallel.host_collectives=false'") from e
            group._all(CREATED, sid, 0, 0)
            self.maps = {}
            for m in range(group.members):
                if m == group.index:
                    self.maps[m] = mmap.mmap(fd, nbytes)
                else:
                    with open(self._file(m), "r+b") as f:
                        self.maps[m] = mmap.mmap(f.fileno(), nbytes)
        finally:
            os.close(fd)
        group._all(HELLO, sid, 0, 0)  # every member has every file mapped
        os.unlink(mine)
        self.regions = {m: np.frombuffer(mp, dtype, self.size * self.n) for m, mp in self.maps.items()}
        self.posts = 0
        self.gen = [0] * self.n  # per region: its posts so far
        self.holder: list[int | None] = [None] * self.n  # per region: the bucket posted there and not yet done
        self.at: dict[int, int] = {}  # bucket -> the region of its newest post
        self.viewed: set[int] = set()  # buckets whose views are out and not done
        self.kept: list[np.ndarray | None] = [None] * self.n  # per region: this member's kept elements (``keep``)
        self.kept_range: dict[int, tuple[int, int] | None] = {}
        self.early: dict[int, tuple[int, np.ndarray]] = {}  # bucket -> (its first element, sum taken at a post)

    def _file(self, m: int) -> str:
        return f"{self.group.prefix}-s{self.sid}-m{m}"

    def region(self, m: int, k: int) -> np.ndarray:
        """Member ``m``'s region holding bucket ``k``'s newest post."""
        r = self.at[k]
        return self.regions[m][r * self.size:r * self.size + self.lengths[k]]

    def post(self, k: int, pieces: list[np.ndarray], keep: tuple[int, int] | None = None) -> None:
        """Write this member's bucket ``k``: ``pieces`` end to end, zeros after them (once every peer is done
        reading the region's previous post), and say so. ``keep=(lo, hi)``: elements no peer reads (this member's
        chunk of a reduce-scatter) go to a private buffer that ``sum(k, lo, hi)`` reads instead."""
        g, r = self.group, self.posts % self.n
        self.posts += 1
        j = self.holder[r]
        if j is not None:  # this member has not read the region's previous bucket yet: sum it now
            if j in self.viewed:
                raise RuntimeError(f"host collectives: bucket {k} posted over bucket {j}, whose views are still "
                                   f"read (done() first; {self.n} regions)")
            lo, hi = self.kept_range[j] or (0, self.lengths[j])
            self.early[j] = (lo, self._sum(j, lo, hi))
        self.gen[r] += 1
        if self.gen[r] > 1:
            g.wait(DONE, self.sid, r, self.gen[r] - 1)
        self.at[k], self.holder[r], self.kept_range[k] = r, k, keep
        region = self.region(g.index, k)
        lo, hi = keep or (0, 0)
        own = self._kept(r, hi - lo)
        at = 0
        for x in pieces:
            x, end = x.reshape(-1), at + x.size
            a, b = max(at, lo), min(end, hi)
            if a < b:  # [a, b) is kept; the rest of the piece goes to the region
                own[a - lo:b - lo] = x[a - at:b - at]
                region[at:a] = x[:a - at]
                region[b:end] = x[b - at:]
            else:
                region[at:end] = x
            at = end
        region[at:] = 0
        if at < hi:
            own[max(at, lo) - lo:hi - lo] = 0
        g.send(READY, self.sid, r, self.gen[r], g.peers)

    def _kept(self, r: int, n: int) -> np.ndarray:
        """Region ``r``'s private buffer of at least ``n`` elements (made once: a chunk of the largest bucket)."""
        kept = self.kept[r]
        if n <= 0:
            return np.empty(0, self.dtype)
        if kept is None or kept.size < n:
            kept = self.kept[r] = np.empty(max(n, -(-self.size // self.group.members)), self.dtype)
        return kept

    def views(self, k: int) -> list[np.ndarray]:
        """Every member's bucket ``k`` of this post, in member order (read-only until ``done``)."""
        r = self.at[k]
        if self.holder[r] != k:
            raise RuntimeError(f"host collectives: bucket {k}'s region holds bucket {self.holder[r]} now (read a "
                               f"gather before posting {self.n} more buckets)")
        self.group.wait(READY, self.sid, r, self.gen[r])
        self.viewed.add(k)
        return [self.region(m, k) for m in range(self.group.members)]

    def done(self, k: int) -> None:
        """This member has read bucket ``k`` of every member: they may write its region again."""
        r = self.at[k]
        self.viewed.discard(k)
        self.holder[r] = None
        self.group.send(DONE, self.sid, r, self.gen[r], self.group.peers)

    def sum(self, k: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Elements [lo, hi) of bucket ``k`` summed over the members in member order, in a new array."""
        hi = self.lengths[k] if hi is None else hi
        if k in self.early:
            first, out = self.early.pop(k)
            return out[lo - first:hi - first]
        return self._sum(k, lo, hi)

    def _sum(self, k: int, lo: int, hi: int) -> np.ndarray:
        parts = [v[lo:hi] for v in self.views(k)]
        kept = self.kept[self.at[k]]
        if self.kept_range.get(k) == (lo, hi) and kept is not None:
            parts[self.group.index] = kept[:hi - lo]
        out = np.empty(hi - lo, self.dtype)
        np.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out += p
        self.done(k)
        return out
