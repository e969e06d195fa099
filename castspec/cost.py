"""Verify-cost profiles and the width rules that turn them into a tree width (paper §3.3, Theorem 2).

A profile holds measured round-time components on one deployment (device, dtype, target, drafter):
target verify latency over packed counts n at a few prefix lengths, the drafter pass, and the host-side
overhead h(N), with the machine's floor under each of them. The round time at width N is
l(N) = draft + h(N) + verify(n = N + 1).
With prefix masses rho_1 >= rho_2 >= ... (the best-first tree's node probabilities), the expected committed
tokens per round is g(N) + 1 = 1 + sum_{i <= N} rho_i, and throughput is (g(N) + 1) / l(N).
"""
from __future__ import annotations

import functools
import hashlib
import heapq
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import numpy as np


def extend_interp(x, xs: list, ys: list):
    """np.interp inside the probed points; past the last one, the last segment's slope goes on (never
    downward). Packed counts beyond the probe are real under load (B requests' trees in one verify): clamping
    them to the last probed cost made a verify of 16 requests x 64 nodes look as cheap as one of 64. A float
    for a number x, an array for an array."""
    x = np.asarray(x, dtype=float)
    out = np.interp(x, xs, ys)
    if len(xs) >= 2:
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        out = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), out)
    return float(out) if out.ndim == 0 else out


def interp_rows(x: float, xp: list, rows: np.ndarray) -> np.ndarray:
    """np.interp(x, xp, column) for every column of rows [len(xp), n] at once, with the same arithmetic."""
    rows = np.asarray(rows, dtype=float)
    if x <= xp[0] or len(xp) < 2:
        return rows[0]
    if x >= xp[-1]:
        return rows[-1]
    j = int(np.searchsorted(xp, x, side="right")) - 1
    slope = (rows[j + 1] - rows[j]) / (xp[j + 1] - xp[j])
    return slope * (x - xp[j]) + rows[j]


# context rows per request in the probed drafter passes (`draft_ms`, batched `draft_ms`): a typical round's commit
DRAFT_CONTEXT_ROWS = 3
# block positions a batched drafter pass finishes (last layer, head) in the probe, and in the cost policy's rounds
# under load until their trees reach deeper (CostAware.draft_depth): a round of many requests pays for every
# verified row, so its trees are shallow, and a pass of 16 blocks is compute
BATCH_DRAFT_DEPTH = 2


@dataclass
class CostProfile:
    key: dict  # device, dtype, target, drafter
    packed: list[int]  # n values probed (n = N + 1, the root included)
    prefix_lens: list[int]
    verify_ms: list[list[float]]  # [prefix][n] median target-forward latency
    draft_ms: list[float]  # [prefix] drafter pass
    host_ms: dict[str, float] = field(default_factory=dict)  # str(N) -> tree + pack + walk + gather
    # batched shapes (serving): str(B) -> {"packed": total packed tokens, "verify_ms": [...], "draft_ms": float}
    batch: dict[str, dict] = field(default_factory=dict)
    prefill_ms: list[float] = field(default_factory=list)  # [prefix] a prompt of that many tokens in one round
    # the physical floor under each measured time (castspec/floor.py), from rates measured in the probe's own run:
    # read_gbps, gemm_gflops, verify_floor_ms [prefix][n], verify_ratio (measured / floor, same shape),
    # draft_floor_ms and draft_ratio [prefix] (None without a drafter), prefill_floor_ms and prefill_ratio
    # [prefix] (absent from profiles without prefill_ms); batched entries carry theirs. None in
    # profiles written before floors were measured.
    floor: dict | None = None
    # [prefix] what each pending context row adds to one drafter pass (ms): a request that has not drafted for a
    # while, or whose prompt the drafter has not read yet, has its pass also fuse those rows. None in profiles
    # written before it was probed
    draft_context_ms: list[float] | None = None
    # [prefix] the 1-row verify timed in the same loop as the drafter pass, each right before a pass: the step the
    # pass is priced against (floor["draft_over_one_row"]). None without a drafter, and in older profiles
    draft_step_ms: list[float] | None = None

    def verify_at(self, n, prefix: float):
        """Verify latency of one request's forward of n packed tokens (a float; an array for an array of n), on
        the measured curve made non-decreasing (`monotone`)."""
        rows = np.stack([np.atleast_1d(extend_interp(n, self.packed, monotone(row))) for row in self.verify_ms])
        out = interp_rows(prefix, self.prefix_lens, rows)
        return float(out[0]) if np.ndim(n) == 0 else out

    def batch_verify_at(self, batch: int, n_total, prefix: float):
        """Verify latency of one ragged forward of `batch` requests with `n_total` packed tokens in all (a float;
        an array for an array of totals).

        Interpolated over the probed batch sizes, with the single-request curve at the same total as batch 1
        (so a batch smaller than the smallest probed one lies between the two, not on the larger batch's curve);
        without batched measurements that curve is the estimate (the projections, which dominate, see only the
        total)."""
        probed = sorted(int(b) for b in self.batch)
        if batch == 1 or not probed:
            return self.verify_at(n_total, prefix)

        def at(b: int):
            if b == 1:
                return self.verify_at(n_total, prefix)
            entry = self.batch[str(b)]
            return extend_interp(n_total, entry["packed"], monotone(entry["verify_ms"]))

        sizes = [1, *probed]
        lo = max(b for b in sizes if b <= batch)
        hi = min([b for b in sizes if b >= batch], default=sizes[-1])
        if lo == hi:
            return at(lo)
        out = interp_rows(batch, [lo, hi], np.stack([np.atleast_1d(at(lo)), np.atleast_1d(at(hi))]))
        return float(out[0]) if np.ndim(n_total) == 0 else out

    def draft_at(self, prefix: float) -> float:
        """One request's drafter pass."""
        return float(np.interp(prefix, self.prefix_lens, self.draft_ms))

    def batch_draft_at(self, batch: int, prefix: float, block_rows: int | None = None) -> float | None:
        """One drafter pass for `batch` requests: the single-request pass at B = 1, else interpolated over the
        probed batch sizes (past the largest, the last slope goes on), which finish BATCH_DRAFT_DEPTH rows a block
        as the cost policy's batched rounds do. Without batched measurements, given the rows of one request's
        block, the single pass scaled as this device's verify cost grows from one block's rows to B blocks' (both
        are mostly the same kind of products: flat where a forward is bound by the weight read, linear where it is
        compute-bound); else None."""
        if batch <= 1:
            return self.draft_at(prefix)
        if not self.batch:
            if not block_rows:
                return None
            return self.draft_at(prefix) * self.verify_at(batch * block_rows, prefix) / max(
                self.verify_at(block_rows, prefix), 1e-9)
        probed = sorted(int(b) for b in self.batch)
        draft_ms = [self.draft_at(prefix), *(self.batch[str(b)]["draft_ms"] for b in probed)]
        return extend_interp(batch, [1, *probed], draft_ms)

    def context_row_ms(self, prefix: float, batch: int = 1, block_rows: int | None = None) -> float:
        """What one more pending context row adds to a drafter pass of `batch` requests (ms). Probed per batch
        size: a pass of one block rides on the weight read and takes context rows almost free, a pass of 16
        blocks is compute and pays for each; interpolated over the probed batch sizes as the pass itself. In
        profiles without it, priced like a row of the probed pass (an upper bound: a context row only feeds the
        drafter's keys and values), given the rows of one request's block; else 0."""
        if not self.draft_context_ms:
            return 0.0 if not block_rows else self.draft_at(prefix) / (block_rows + DRAFT_CONTEXT_ROWS)
        single = float(np.interp(prefix, self.prefix_lens, self.draft_context_ms))
        probed = sorted(int(b) for b in self.batch if "draft_context_ms" in self.batch[b])
        if batch <= 1 or not probed:
            return single
        return max(float(extend_interp(batch, [1, *probed],
                                       [single, *(self.batch[str(b)]["draft_context_ms"] for b in probed)])), 0.0)

    def plain_round_ms(self, batch: int, prefix: float) -> float:
        """A round without a draft: the verify of `batch` roots and the host work of their empty trees."""
        return self.batch_verify_at(batch, batch, prefix) + self.batch_host_at(batch, 0)

    def batch_host_at(self, batch: int, nodes):
        """Host work of a round of `batch` requests with `nodes` tree nodes in all (a float or an array): each
        request's marginals, tree, pack, walk and commit are its own work, so `batch` times one request's at its
        share of the nodes (the probe times one request's)."""
        batch = max(batch, 1)
        return batch * self.host_at(nodes / batch)  # host_at takes a number or an array, as `nodes` comes

    def host_at(self, width):
        """Host work per round at width N (a float; an array for an array of widths)."""
        if not self.host_ms:
            return 0.0 if np.ndim(width) == 0 else np.zeros(np.shape(width))
        xs = sorted(int(k) for k in self.host_ms)
        out = np.interp(width, xs, [self.host_ms[str(x)] for x in xs])
        return float(out) if np.ndim(width) == 0 else out

    def round_ms(self, width: int, prefix: float) -> float:
        """l(N): one round at width N (N = 0 is a plain autoregressive step without a draft)."""
        draft = self.draft_at(prefix) if width > 0 else 0.0
        return draft + self.host_at(width) + self.verify_at(width + 1, prefix)

    def round_table(self, max_width: int, prefix: float) -> np.ndarray:
        """l(N) for N = 0..max_width, made non-decreasing so marginal costs are never negative (noise)."""
        table = np.array([self.round_ms(w, prefix) for w in range(max_width + 1)])
        table[1:] = np.maximum.accumulate(table[1:])
        return table

    def verify_table(self, max_width: int, prefix: float, batch: int = 1) -> np.ndarray:
        """h(N) + verify(N + B) for N = 0..max_width tree nodes in all (non-decreasing): a round's cost once its
        draft is paid, for B requests (each with its root) in one ragged verify."""
        widths = np.arange(max_width + 1)
        return np.maximum.accumulate(self.batch_host_at(batch, widths)
                                     + self.batch_verify_at(batch, widths + batch, prefix))

    @property
    def max_width(self) -> int:
        return max(self.packed) - 1

    def save(self, path: Path) -> None:
        """Write atomically: readers and other processes saving the same profile see the old file or the new
        one, never a partial one (a failed write leaves the old file as it was)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(asdict(self), indent=2)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())  # the new contents reach the disk before the name points at them
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @staticmethod
    def load(path: Path) -> "CostProfile":
        """A saved profile; fields this version does not know (written by a newer one) are left out, so that
        revisions sharing one cache (a paired comparison with an older checkout) read each other's profiles."""
        known = {f.name for f in fields(CostProfile)}
        return CostProfile(**{k: v for k, v in json.loads(Path(path).read_text()).items() if k in known})


def profile_key(device: str, dtype: str, target: str, drafter: str) -> dict:
    return {"device": device, "dtype": dtype, "target": target, "drafter": drafter}


def profile_path(cache: Path, key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache / "profiles" / f"{key['device']}-{key['dtype']}-{digest}.json"


def affine_fit(profile: CostProfile, prefix: float, max_width: int | None = None) -> tuple[float, float]:
    """Least-squares c0 + c1 * n of verify(n) + h(n - 1) over the probed packed counts (draft excluded)."""
    ns = [n for n in profile.packed if max_width is None or n <= max_width + 1]
    ys = [profile.verify_at(n, prefix) + profile.host_at(n - 1) for n in ns]
    c1, c0 = np.polyfit(ns, ys, 1)
    return float(c0), float(max(c1, 0.0))


def throughput(masses: np.ndarray, table: np.ndarray, roots: int = 1) -> np.ndarray:
    """(g(N) + B) / l(N) for N = 0..len(table)-1 from sorted masses rho_1 >= rho_2 >= ... (B = roots: each
    request in the round commits its target token whatever the tree)."""
    g = np.concatenate([[0.0], np.cumsum(masses)])[:len(table)]
    return (g + roots) / table[:len(g)]


def width_affine(masses: np.ndarray, profile: CostProfile, prefix: float, max_width: int) -> int:
    """The paper's rule: add node N+1 while rho_(N+1) >= (g(N) + 1) / l(N) * c1, with l and c1 affine."""
    c0, c1 = affine_fit(profile, prefix, max_width)
    draft = profile.draft_at(prefix)
    g = 0.0
    for n in range(min(max_width, len(masses))):
        ell = draft + c0 + c1 * (n + 1)
        if masses[n] < (g + 1.0) / ell * c1:
            return n
        g += masses[n]
    return min(max_width, len(masses))


def width_table(masses: np.ndarray, profile: CostProfile, prefix: float, max_width: int) -> int:
    """Maximize (g(N) + 1) / l(N) over the measured (interpolated) cost table: survives cost cliffs."""
    table = profile.round_table(min(max_width, len(masses)), prefix)
    thr = throughput(np.asarray(masses, dtype=float), table)
    return int(np.argmax(thr))


@dataclass
class Calibration:
    """Online recalibration of drafter masses from acceptance observed while decoding.

    Nodes are binned by depth and by log10 of their predicted mass; each bin keeps (hits, trials) with a prior
    pulling toward the raw prediction. Calibrated probabilities are made monotone in the predicted mass
    within each depth (pool-adjacent-violators), so ordering by calibrated mass keeps the tree prefix-closed
    whenever raw ordering did.
    """

    depths: int = 16
    bins: int = 12
    prior: float = 4.0
    hits: np.ndarray = None
    trials: np.ndarray = None
    predicted: np.ndarray = None

    def __post_init__(self):
        shape = (self.depths + 1, self.bins)
        self.hits = np.zeros(shape) if self.hits is None else self.hits
        self.trials = np.zeros(shape) if self.trials is None else self.trials
        self.predicted = np.zeros(shape) if self.predicted is None else self.predicted

    def _bin(self, mass: np.ndarray) -> np.ndarray:
        # bins over log10 mass in [-6, 0]
        x = np.clip(np.log10(np.maximum(mass, 1e-12)), -6, 0)
        return np.minimum(((x + 6) / 6 * self.bins).astype(int), self.bins - 1)

    def observe(self, depths, masses, accepted) -> None:
        d = np.minimum(np.asarray(depths), self.depths)
        b = self._bin(np.asarray(masses, dtype=float))
        np.add.at(self.trials, (d, b), 1)
        np.add.at(self.hits, (d, b), np.asarray(accepted, dtype=float))
        np.add.at(self.predicted, (d, b), np.asarray(masses, dtype=float))

    def apply(self, depths, masses) -> np.ndarray:
        masses = np.asarray(masses, dtype=float)
        d = np.minimum(np.asarray(depths), self.depths)
        b = self._bin(masses)
        mean_pred = np.where(self.trials > 0, self.predicted / np.maximum(self.trials, 1), 0)
        # posterior mean of the hit rate with `prior` pseudo-trials at the bin's mean prediction
        rate = (self.hits + self.prior * mean_pred) / (self.trials + self.prior)
        rate = np.stack([pava(row, self.trials[i] + self.prior) for i, row in enumerate(rate)])
        ratio = np.where((self.trials[d, b] > 0) & (mean_pred[d, b] > 0), rate[d, b] / np.maximum(mean_pred[d, b], 1e-12), 1.0)
        return np.clip(masses * ratio, 0.0, 1.0)


def monotone(times) -> np.ndarray:
    """Measured latencies over increasing shapes as the closest non-decreasing curve (least squares, each
    measurement weighted alike): more rows never cost less, and one slow measurement (a hiccup of a shared
    machine during a quick probe) is pooled with its neighbours instead of raising every larger shape's price,
    as a running maximum would (it made width="auto" take 21-node trees to pay for a step that was not there)."""
    return np.array(_monotone(tuple(float(t) for t in times)))


@functools.lru_cache(maxsize=256)
def _monotone(times: tuple[float, ...]) -> tuple[float, ...]:
    """monotone's fit, kept per curve: the cost policy prices rounds from the same few measured curves every
    round under load, and a profile's curves are plain values (a changed curve is another key)."""
    return tuple(pava(np.array(times), np.ones(len(times))))


def pava(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Non-decreasing least-squares fit (pool adjacent violators)."""
    blocks = [[float(v), float(w), 1] for v, w in zip(values, weights)]
    out = []
    for blk in blocks:
        out.append(blk)
        while len(out) > 1 and out[-2][0] > out[-1][0]:
            v2, w2, n2 = out.pop()
            v1, w1, n1 = out.pop()
            w = w1 + w2
            out.append([(v1 * w1 + v2 * w2) / max(w, 1e-12), w, n1 + n2])
    return np.concatenate([[v] * n for v, _, n in out])


def least_slopes(table: np.ndarray) -> np.ndarray:
    """slopes[n] = min over m > n of (l(m) - l(n)) / (m - n): what any node after the n-th costs at least, on
    average (inf for the last). Linear in the table's length, through the lower convex hull of the points right of
    n, built from the right: the least slope from n is to the hull vertex where n's tangent touches it, and the
    vertices before that one lie above the line from n to it, so they leave the hull as n joins. (Every pair of
    counts at once cost ~10 ms for a batch of 16's table of ~1,000 counts, in the first drafted round of that
    batch.)"""
    t = np.asarray(table, dtype=float).tolist()
    out = np.full(len(t), np.inf)
    hull: list[int] = []  # the lower hull of the points right of n, the leftmost last
    for n in range(len(t) - 1, -1, -1):
        while len(hull) > 1 and (t[hull[-2]] - t[n]) / (hull[-2] - n) <= (t[hull[-1]] - t[n]) / (hull[-1] - n):
            hull.pop()
        if hull:
            out[n] = (t[hull[-1]] - t[n]) / (hull[-1] - n)
        hull.append(n)
    return out


def best_prefix(scores: list[float], table: list[float], lam: float) -> int:
    """How many of one request's best-first nodes (log masses `scores`) maximize their summed mass minus lam
    times the verify cost table[n]: the first n of the largest value, as RoundWidth.allocate's argmax."""
    best, best_value, gain = 0, -lam * table[0], 0.0
    for n, score in enumerate(scores[:len(table) - 1], start=1):
        gain += math.exp(score)
        value = gain - lam * table[n]
        if value > best_value:
            best, best_value = n, value
    return best


def mean_prefix(prefixes: list[int]) -> int:
    """The batch's mean prefix length, rounded down (0 for none): which cost table a round reads."""
    return sum(prefixes) // len(prefixes) if prefixes else 0


class RoundWidth:
    """The per-round (Lagrangian) rule: the width N maximizing sum_{i<=N} rho_i - lambda * l(N), i.e. keep node
    i while rho_i >= lambda * (l(i) - l(i-1)) where costs are convex.

    lambda is the running throughput estimate (committed tokens per ms), so the width follows each prompt and
    round. It starts from the static expectation and then tracks measured rounds (EMA).
    """

    def __init__(self, profile: CostProfile, max_width: int, init_throughput: float | None = None,
                 calibration: Calibration | None = None, momentum: float = 0.8):
        self.profile, self.max_width = profile, max_width
        self.calibration = calibration
        self.momentum = momentum
        self.lam = init_throughput
        # (prefix bucket, batch size) -> verify table l, the least average slope of l after each count, and l as a
        # list (what one request's round reads: a few floats, where numpy's calls cost more than the arithmetic)
        self._tables: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, list[float]]] = {}

    def _costs(self, prefix: int, batch: int) -> tuple[np.ndarray, np.ndarray, list[float]]:
        bucket = int(2 ** round(math.log2(max(prefix, 16))))  # a few tables per run, not one per round
        if (bucket, batch) not in self._tables:
            # the draft is already paid when the round decides its width: only verify + host costs are marginal
            table = self.profile.verify_table(self.max_width * batch, bucket, batch)
            self._tables[bucket, batch] = table, least_slopes(table), table.tolist()
        return self._tables[bucket, batch]

    def _table(self, prefix: int, batch: int) -> np.ndarray:
        return self._costs(prefix, batch)[0]

    def _lambda(self, min_throughput: float | None) -> float | None:
        """The throughput a node must pay for: lambda, no lower than `min_throughput` (a rate other rounds
        reach); that rate alone before lambda is measured (under load, where plain rounds are measured first, a
        batch's first drafted rounds then stop building nodes early too)."""
        if self.lam is None or min_throughput is None:
            return self.lam if min_throughput is None else min_throughput
        return max(self.lam, min_throughput)

    def stop_rule(self, prefixes: list[int],
                  min_throughput: float | None = None) -> Callable[[int, float], bool] | None:
        """For build_forest: a test that ends a batched round's best-first selection once no further node can
        change what `allocate` picks, so a round of B requests builds the few nodes that pay, not B full trees.
        After n nodes, any later prefix adds at most the best remaining mass per node and costs at least
        slopes[n] per node; when that mass is at most lambda * slopes[n], none beats the best so far. None where
        the bound does not hold: before lambda is measured where no other rate is given (allocate then derives it
        from all the masses) and with calibrated masses (which need not fall along the order)."""
        lam = self._lambda(min_throughput)
        if lam is None or self.calibration is not None:
            return None
        slopes = self._costs(mean_prefix(prefixes), len(prefixes))[1]
        return lambda taken, score: taken >= len(slopes) - 1 or math.exp(score) <= lam * slopes[taken]

    def choose(self, scores: list[float], depths: list[int], prefix: int) -> int:
        """Width for this round from its best-first node scores (log masses, descending)."""
        return self.allocate([scores], [depths], [prefix])[0]

    def allocate(self, scores: list[list[float]], depths: list[list[int]], prefixes: list[int],
                 min_throughput: float | None = None) -> list[int]:
        """Nodes per request for one batched round (Proposition 3): the best candidates of all requests, as many
        as maximize their summed mass minus lambda times the batch's verify cost (throughput lambda).
        `min_throughput`: a rate other rounds are known to reach (plain rounds without a draft): a node must pay
        for its cost at that rate too, or the round would do better without it."""
        B = len(scores)
        lam = self._lambda(min_throughput)
        if B == 1 and lam is not None and self.calibration is None:
            return [best_prefix(scores[0][:self.max_width], self._costs(mean_prefix(prefixes), 1)[2], lam)]
        masses = []
        for sc, dp in zip(scores, depths):
            m = np.exp(np.asarray(sc, dtype=float))[:self.max_width]
            if self.calibration is not None and len(m):
                m = self.calibration.apply(dp[:len(m)], m)
            masses.append(m)
        table = self._table(mean_prefix(prefixes), B)
        if lam is None:
            merged = np.sort(np.concatenate(masses))[::-1] if masses else np.zeros(0)
            lam = float(np.max(throughput(merged, table[:len(merged) + 1], roots=B)))
            if min_throughput is not None:
                lam = max(lam, min_throughput)
        # every request's candidates in one best-first order (each request's own order kept, so its trees
        # stay prefix-closed), then the prefix of that order maximizing gain - lambda * cost: the greedy stop
        # "add while rho >= lambda * delta l" is the same answer on convex costs, but measured costs have steps
        # (the first extra packed row costs more than the next few), and a greedy stop would refuse a whole
        # cheap tree because its first node alone does not pay for the step
        if B == 1:  # one request's candidates are already in best-first order
            order = [0] * min(len(masses[0]), len(table) - 1)
            gains = np.concatenate([[0.0], np.cumsum(masses[0][:len(order)])])
        else:
            order, gains = [], [0.0]
            heap = [(-m[0], i, 0) for i, m in enumerate(masses) if len(m)]
            heapq.heapify(heap)
            while heap and len(order) + 1 < len(table):
                neg, i, k = heapq.heappop(heap)
                order.append(i)
                gains.append(gains[-1] - neg)
                if k + 1 < len(masses[i]):
                    heapq.heappush(heap, (-masses[i][k + 1], i, k + 1))
        best = int(np.argmax(np.asarray(gains) - lam * table[:len(gains)]))
        taken = [0] * B
        for i in order[:best]:
            taken[i] += 1
        return taken

    def observe(self, tree, path: list[int]) -> None:
        """Feed a verified tree's outcome to the calibration (path: accepted pack rows, node i is row i + 1)."""
        if self.calibration is None or len(tree.scores) == 0:
            return
        accepted = np.zeros(len(tree.scores))
        accepted[[r - 1 for r in path]] = 1.0
        self.calibration.observe(list(tree.depths), np.exp(np.asarray(tree.scores, dtype=float)), accepted)

    def update(self, committed: int, round_ms: float) -> None:
        """Blend a measured round into lambda."""
        rate = committed / max(round_ms, 1e-6)
        self.lam = rate if self.lam is None else self.momentum * self.lam + (1 - self.momentum) * rate
