"""Running a draft job over any executor (MLX, Core ML): the token tree in the KV cache, the
masks and positions of batched branch rollouts, and the choice of each drafted token.

Cache layout. Slots [0, len(trunk)) hold one linear token sequence, the trunk; the slots after
it hold branches ("paths"), each hanging off the trunk at some position. A token of a branch
attends to the trunk up to where its branch leaves it and to its own branch's earlier slots,
so many branches advance in one batched forward: one forward per drafted token, whatever the
number of branches.

A job that compacts (the first of each decoding step) makes its first sequence the main line:
the deepest prefix of it that the cache holds (the trunk, possibly continued along a branch the
previous step rolled out, whose slots are gathered into place) becomes the trunk, and the
other branches are forgotten. Other jobs only add branches.

A draft that reads the target's features (draft/net.py) feeds each token with one of: the
target's features after the token before it (where the target has computed them: `Features`
of the jobs), or else the draft's own last hidden state at the slot before it. Each slot
remembers whether it was fed the target's features (`exact`); when a compacting job brings
the target's features for main-line tokens that were fed the draft's own (accepted drafts), the
cache is cut before the first of them and they are fed again, as EAGLE does, so that the draft
reads the committed text as the target saw it. They are fed in the job's first forward, beside
its first drafted position: the refresh costs no forward of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..decode.sampling import distribution
from .base import Features, Job, JobResult, Rollout

PREFILL_CHUNK = 512
# A compacting job's missing main-line tokens up to this many are fed by its first rollout
# forward, not by a forward of their own.
MERGE_FEED = 64

# Where a token's feature comes from (a draft that reads features): nothing (the first token),
# the target (a row of `FeatureRefs.target`), the draft's own output at a slot (`ref`), or the
# feature a slot was fed before (`ref`: feeding it again where the target's is not known).
ZERO, TARGET, OWN, FED = 0, 1, 2, 3

# Sampling distributions are computed on a CPU stream of their own: on the default stream
# (the GPU on a Mac) each drafted token would queue behind the target's work the decoder has
# just dispatched with mx.async_eval, and the draft would stop overlapping it.
_SAMPLING_STREAM = mx.new_thread_local_stream(mx.cpu)


@dataclass
class FeatureRefs:
    kinds: list[int]
    refs: list[int]  # a row of `target` (TARGET) or a slot (OWN, FED)
    target: list[np.ndarray]  # the target's feature rows the TARGET tokens read


class Executor(Protocol):
    """Runs the draft network over its own KV cache."""

    vocab_size: int
    head_ids: np.ndarray  # head index -> token id
    streams: int  # tokens each forward predicts beyond the next one (speculative streaming)
    reads_features: bool  # a feature-conditioned draft: `forward` takes FeatureRefs

    def truncate(self, size: int) -> None:
        """Keep slots [0, size)."""

    def gather(self, dst: int, slots: list[int]) -> None:
        """Move the given slots to [dst, dst + len(slots)); the cache then ends there."""

    def forward(self, tokens: list[int], positions: list[int] | int, mask: np.ndarray | None,
                rows: list[int], features: FeatureRefs | None = None) -> np.ndarray:
        """Append `tokens` at the cache's end; return float32 logits (len(rows), 1 + streams,
        head size) for the listed token rows: the next token, then (with speculative
        streaming) the ones after it. `positions`: one per token, or an int (contiguous).
        `mask`: bool (len(tokens), cache size after the append), True = may attend; None =
        causal over the whole cache. `features`: each token's feature (a draft that reads
        features); a token may read the own output of one fed before it in the same call."""


def common_prefix(a: list[int], b: list[int], start: int = 0, stop: int | None = None) -> int:
    """The length of the longest common prefix of a[:stop] and b[:stop], given that their
    first `start` tokens are equal. Slices compare in C: a context's worth of tokens costs
    microseconds where a Python loop over it costs milliseconds."""
    n = min(len(a), len(b), len(a) if stop is None else stop)
    lo = min(start, n)
    if a[lo:n] == b[lo:n]:
        return n
    hi = n  # the first difference lies in [lo, hi): halve the range in C down to a few
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo


@dataclass
class Path:
    """A branch: tokens at positions [start, start + len) whose KV sits in `slots`."""

    start: int
    tokens: list[int]
    slots: list[int]


@dataclass
class TreeState:
    trunk: list[int] = field(default_factory=list)  # its own list, changed in place
    paths: list[Path] = field(default_factory=list)
    size: int = 0  # slots in use
    exact: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # per slot (features)
    settled: int = 0  # leading trunk slots known to be exact
    stale: dict[int, int] = field(default_factory=dict)  # main position -> slot it was fed at
    # The target's features after positions of `line` (rows where `have`), from the jobs.
    line: list[int] = field(default_factory=list)
    rows: np.ndarray | None = None
    have: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    # The last job's committed tokens (Job.committed), and how far `trunk` and `line` are known
    # to agree with them: comparisons with a later job's sequences start there.
    committed: list[int] | None = None
    committed_len: int = 0
    trunk_ok: int = 0
    line_ok: int = 0

    def begin(self, committed: list[int] | None, size: int) -> None:
        """A job whose sequences begin with committed[:size] starts: what is known about
        agreement with the last job's holds if they are the same list, grown."""
        if committed is None or committed is not self.committed or size < self.committed_len:
            self.trunk_ok = self.line_ok = 0
        self.committed = committed
        self.committed_len = size

    def set_trunk(self, seq: list[int], agree: int, depth: int) -> None:
        """Make the trunk seq[:depth], given that it agrees with seq on its first `agree`."""
        del self.trunk[min(agree, depth):]
        self.trunk += seq[len(self.trunk) : depth]
        self.trunk_ok = min(depth, self.committed_len)

    def agreement(self, seq: list[int]) -> int:
        """How many leading tokens `seq` (a sequence of the current job) shares with `line`."""
        p = common_prefix(seq, self.line, min(self.line_ok, len(seq), len(self.line)))
        self.line_ok = max(self.line_ok, min(p, self.committed_len))
        return p

    def learn(self, f: Features) -> None:
        known = min(self.line_ok, f.start, self.committed_len)
        same = common_prefix(self.line, f.line, known)
        keep = min(same, f.start, len(self.have))
        end = f.start + len(f.rows)
        if self.rows is None or len(self.rows) < end:
            grown = np.zeros((max(end, 2 * len(self.have)), f.rows.shape[1]), np.float32)
            if self.rows is not None:
                grown[: len(self.rows)] = self.rows
            self.rows = grown
            have = np.zeros(len(grown), bool)
            have[: len(self.have)] = self.have
            self.have = have
        self.have[keep:] = False
        self.rows[f.start : end] = f.rows
        self.have[f.start : end] = True
        del self.line[same:]
        self.line += f.line[same:]
        self.line_ok = max(min(same, self.line_ok), min(f.start, self.committed_len))

    def mark(self, at: int, kinds: list[int]) -> None:
        """Slots from `at` were just fed tokens whose features came from `kinds`."""
        end = at + len(kinds)
        if len(self.exact) < end:
            grown = np.zeros(max(end, 2 * len(self.exact)), bool)
            grown[: len(self.exact)] = self.exact
            self.exact = grown
        self.exact[at:end] = np.isin(kinds, (TARGET, ZERO))

    def target_row(self, p: int, agree: int) -> np.ndarray | None:
        """The target's features after position p of a sequence that agrees with `line` on
        its first `agree` tokens, if known."""
        if 0 <= p < min(agree, len(self.have)) and self.have[p]:
            return self.rows[p]
        return None

    def target_rows(self, start: int, stop: int, agree: int) -> np.ndarray:
        """Whether target_row is known for each of the positions [start, stop)."""
        known = np.zeros(max(0, stop - start), bool)
        end = min(stop, agree, len(self.have))
        if end > start:
            known[: end - start] = self.have[start:end]
        return known

    def deepest(self, seq: list[int], stop: int | None = None
                ) -> tuple[int, Path | None, int, int]:
        """Longest prefix of seq[:stop] in the cache: (length, branch it runs along, tokens
        of it, tokens it shares with the trunk)."""
        stop = len(seq) if stop is None else stop
        p = common_prefix(self.trunk, seq, min(self.trunk_ok, stop), stop)
        self.trunk_ok = max(self.trunk_ok, min(p, self.committed_len))
        best, via, used = p, None, 0
        for path in self.paths:
            if path.start == p:
                m = common_prefix(path.tokens, seq[p:stop])
                if p + m > best:
                    best, via, used = p + m, path, m
        return best, via, used, p


def _compact(main: list[int], stop: int, ex: Executor, state: TreeState) -> int:
    """Make the cached prefix of main[:stop] the trunk; returns its length. A draft that reads
    features keeps it only up to the first token that is to be fed again (see above)."""
    depth, via, used, agree_trunk = state.deepest(main, stop)
    keep = depth - used
    state.stale = {}
    if ex.reads_features:
        def slot(p: int) -> int:
            return p if p < keep else via.slots[p - keep]

        agree = state.agreement(main)
        # The first token to feed again: one fed the draft's own feature where the target's
        # is known now. On the trunk, found in numpy (`settled` may lie far back).
        lo = max(1, min(state.settled, keep))
        hi = max(lo, min(keep, depth))
        again = ~state.exact[lo:hi] & state.target_rows(lo - 1, hi - 1, agree)
        first = lo + int(np.argmax(again)) if again.any() else None
        if first is None:
            first = next((p for p in range(hi, depth) if not state.exact[slot(p)]
                          and state.target_row(p - 1, agree) is not None), None)
        if first is not None:
            p = first
            state.stale = {q: slot(q) for q in range(p, depth)}
            depth, used, keep = p, max(0, p - keep), min(keep, p)
    if via is not None and used:
        ex.gather(keep, via.slots[:used])
        if ex.reads_features:
            state.mark(keep, [TARGET if e else OWN for e in state.exact[via.slots[:used]]])
    else:
        ex.truncate(keep)
    state.set_trunk(main, agree_trunk, depth)
    state.paths, state.size = [], depth
    state.settled = min(state.settled, depth)
    if ex.reads_features and state.settled < depth:
        run = state.exact[state.settled : depth]  # in numpy: after a prefill it is all of it
        state.settled += len(run) if run.all() else int(np.argmin(run))
    return depth


def _refs(start: int, stop: int, state: TreeState, agree: int, first: int, slot0: int,
          stale=None) -> FeatureRefs:
    """Features of a sequence's tokens at positions [start, stop) (the sequence agrees with
    the target's `line` on its first `agree`), fed into slots slot0, slot0 + 1, ...: the
    target's where known, else the draft's own output at the slot holding the token before
    (`first` for the one before `start`), or, with `stale` (position -> slot or None), what
    the token's earlier slot was fed."""
    refs = FeatureRefs([], [], [])
    for p in range(start, stop):
        row = state.target_row(p - 1, agree)
        if row is not None:
            refs.kinds.append(TARGET)
            refs.refs.append(len(refs.target))
            refs.target.append(row)
        elif p == 0:
            refs.kinds.append(ZERO)
            refs.refs.append(0)
        elif stale is not None and stale(p) is not None:
            refs.kinds.append(FED)
            refs.refs.append(stale(p))
        else:
            refs.kinds.append(OWN)
            refs.refs.append(first if p == start else slot0 + p - start - 1)
    return refs


def not_drafted(top_k: int) -> Rollout:
    """The rollout of a sequence a copy-only job does not draft (Job.copy_only)."""
    return Rollout([], np.zeros((0, top_k), np.int64), np.zeros((0, top_k), np.float32), None,
                   True)


class JobSeeds:
    """The draft's randomness: a generator of its own for each job, drawn from the seed and
    the job's number. A job cancelled midway (when verification lands, a matter of timing)
    draws as many numbers as it got to; sharing one generator, the jobs after it would then
    draw other numbers from run to run, and a seeded generation would not repeat."""

    _STREAM = 0x6D697272  # keeps the draft's streams apart from the sampler's, seeded alike

    def __init__(self) -> None:
        self.reseed(None)

    def reseed(self, seed: int | None) -> None:
        self._seed, self._jobs = seed, 0

    def next(self) -> np.random.Generator:
        self._jobs += 1
        return np.random.default_rng(
            None if self._seed is None else (self._STREAM, self._seed, self._jobs))


def run_job(job: Job, ex: Executor, state: TreeState, rng: np.random.Generator,
            top_k: int = 4) -> JobResult:
    try:
        return _run(job, ex, state, rng, top_k)
    except BaseException:
        # The cache may be half-updated: forget it; the next job prefills afresh.
        state.trunk, state.paths, state.size, state.settled = [], [], 0, 0
        state.trunk_ok = 0
        ex.truncate(0)
        raise


def _run(job: Job, ex: Executor, state: TreeState, rng: np.random.Generator,
         top_k: int) -> JobResult:
    start = time.perf_counter()
    # The sequences are read, never copied whole nor kept: what the state keeps it copies.
    seqs = job.sequences
    if not seqs or any(not s for s in seqs):
        raise ValueError("a draft job needs non-empty sequences")
    state.begin(job.committed, job.committed_len)
    # Each sequence's last token is fed by the rollout, which needs its logits; a prefill
    # (n == 0) stops before it and leaves it to the next job.
    caps = [len(s) - 1 for s in seqs]
    fed = 0
    reused = 0
    for f in job.features:
        state.learn(f)
    if job.copy_only:
        return JobResult([not_drafted(top_k)] * len(seqs), start, time.perf_counter(), job.label)
    if job.compact:
        reused = _compact(seqs[0], caps[0], ex, state)
        # Extend the trunk with what every sequence shares (all share the committed tokens).
        shared = min(caps)
        for s in seqs[1:]:
            shared = common_prefix(seqs[0], s, min(state.committed_len, shared), shared)
        missing = shared - len(state.trunk)
        if missing > 0 and (job.n == 0 or len(seqs) > 1 or missing > MERGE_FEED):
            main = seqs[0]
            agree = state.agreement(main)
            for at in range(len(state.trunk), shared, PREFILL_CHUNK):
                end = min(at + PREFILL_CHUNK, shared)
                refs = _refs(at, end, state, agree, at - 1, at, state.stale.get) \
                    if ex.reads_features else None
                ex.forward(main[at:end], at, None, [], refs)
                if refs is not None:
                    state.mark(at, refs.kinds)
            fed += missing
            state.set_trunk(main, len(state.trunk), shared)
            state.size = shared
    if job.n == 0:
        return JobResult([], start, time.perf_counter(), job.label, fed_tokens=fed,
                         reused_tokens=reused)

    # Roll out every sequence as a branch, one batched forward per drafted token.
    branches = []
    for s, cap in zip(seqs, caps):
        depth, via, m, _ = state.deepest(s, cap)
        branches.append(Path(depth - m, via.tokens[:m] if via else [],
                             via.slots[:m] if via else []))
        if not job.compact:
            reused += depth
    # How far each sequence agrees with the target's line (its drafts are compared as they
    # come: `agree_drafted`).
    agree = [state.agreement(s) for s in seqs] if ex.reads_features else []
    feed = [s[b.start + len(b.tokens):] for s, b in zip(seqs, branches)]
    drafted: list[list[int]] = [[] for _ in seqs]
    tops, top_probs, qs = [[] for _ in seqs], [[] for _ in seqs], [[] for _ in seqs]
    forwards = 0
    sure = [1.0] * len(seqs)  # the draft's chance that each rollout is accepted so far
    ended = [False] * len(seqs)
    # With speculative streaming a forward drafts 1 + streams tokens per branch.
    for _ in range(-(-job.n // (1 + ex.streams))):
        if job.cancel is not None and job.cancel.is_set():
            break
        active = [b for b in range(len(seqs)) if not ended[b]]
        if not active:
            break
        tokens, positions, owners = [], [], []
        refs = FeatureRefs([], [], []) if ex.reads_features else None
        for b in active:
            toks = feed[b]
            path = branches[b]
            at = path.start + len(path.tokens)
            if refs is not None:
                mine = _refs(at, at + len(toks), state, _agree_drafted(
                                 agree[b], seqs[b], drafted[b], state.line),
                             path.slots[-1] if path.tokens else path.start - 1,
                             state.size + len(tokens),
                             state.stale.get if b == 0 and job.compact else None)
                refs.kinds += mine.kinds
                refs.refs += [r + len(refs.target) if k == TARGET else r
                              for k, r in zip(mine.kinds, mine.refs)]
                refs.target += mine.target
            tokens += toks
            positions += range(at, at + len(toks))
            owners += [b] * len(toks)
        new_size = state.size + len(tokens)
        mask = np.zeros((len(tokens), new_size), dtype=bool)
        rows = []
        for i, b in enumerate(owners):
            path = branches[b]
            path.tokens.append(tokens[i])
            path.slots.append(state.size + i)
            mask[i, : path.start] = True
            mask[i, path.slots] = True
            if i + 1 == len(owners) or owners[i + 1] != b:
                rows.append(i)
        logits = ex.forward(tokens, positions, mask, rows, refs)
        if refs is not None:
            state.mark(state.size, refs.kinds)
        state.stale = {}
        forwards += 1
        fed += len(tokens)
        state.size = new_size
        take = min(logits.shape[1], job.n - len(drafted[active[0]]))
        chosen = _choose(logits[:, :take].reshape(-1, logits.shape[-1]), ex.head_ids,
                         ex.vocab_size, job, rng, top_k)
        feed = [[] for _ in seqs]
        for i, (token, ids, probs, q, p) in enumerate(chosen):
            b = active[i // take]
            if ended[b]:
                continue
            sure[b] *= p
            if sure[b] < job.min_confidence:
                ended[b] = True  # this token, and any after it, is not worth verifying
                continue
            drafted[b].append(token)
            feed[b].append(token)
            tops[b].append(ids)
            top_probs[b].append(probs)
            if q is not None:
                qs[b].append(q)
    state.paths += [b for b in branches if b.tokens]
    rollouts = [
        Rollout(drafted[b], np.array(tops[b]) if tops[b] else np.zeros((0, top_k), np.int64),
                np.array(top_probs[b]) if tops[b] else np.zeros((0, top_k), np.float32),
                np.stack(qs[b]) if qs[b] else None, ended[b])
        for b in range(len(seqs))
    ]
    return JobResult(rollouts, start, time.perf_counter(), job.label, fed_tokens=fed,
                     forwards=forwards, reused_tokens=reused)


def _agree_drafted(agree: int, seq: list[int], drafted: list[int], line: list[int]) -> int:
    """How far seq + drafted agrees with `line`, given that seq agrees on its first `agree`."""
    if agree < len(seq):
        return agree
    return agree + common_prefix(drafted, line[agree : agree + len(drafted)])


def _choose(logits: np.ndarray, head_ids: np.ndarray, vocab: int, job: Job, rng, top_k: int):
    """Per row: (token, top-k token ids, their probabilities, full-vocabulary q or None, the
    draft's confidence: its best token's probability. Never the drawn token's: stopping on
    that would draw from q cut to its likely tokens while verification divides by q.)"""
    if job.sampling is None:
        z = logits - logits.max(axis=-1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=-1, keepdims=True)
    else:
        with mx.stream(_SAMPLING_STREAM):
            p = np.array(distribution(mx.array(logits), job.sampling))
    k = min(top_k, p.shape[-1])
    out = []
    for row in p:
        idx = np.argpartition(-row, k - 1)[:k]
        idx = idx[np.argsort(-row[idx])]
        ids = head_ids[idx]
        if job.sampling is None:
            out.append((int(ids[0]), ids, row[idx], None, float(row[idx[0]])))
            continue
        cdf = np.cumsum(row, dtype=np.float64)
        pick = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")),
                   len(row) - 1)
        q = np.zeros(vocab, dtype=np.float32)
        q[head_ids] = row
        out.append((int(head_ids[pick]), ids, row[idx], q, float(row[idx[0]])))
    return out
