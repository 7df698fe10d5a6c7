"""Adaptive draft length (`--gamma auto`): how many tokens a step drafts.

Drafting token k of a window costs a draft forward c_d and makes verification longer by c_v;
it pays only if the window survives to it, with probability a_k (the product of the draft's
confidences in tokens 1..k, which a distilled draft roughly calibrates). Worth it while
a_k * t_1 > c_d + c_v, t_1 being a target step over one token (what target-only decoding pays
per token). Every token drafted under that rule is expected to earn more than it costs, so a
step never costs more than target-only decoding for what it is expected to commit; when even
the first token fails the rule, the step verifies nothing and is a target-only step.

Copies from the context (prompt lookup) cost no drafting, but each copied token still costs
verification, and how far a copy survives depends on the temperature (at 0 a quoted passage is
copied whole; at 1.0 the target rarely repeats itself word for word). So copied token k is
verified while a_k * t_1 exceeds what it adds to the step, T(k) - T(k - 1), a_k now being the
chance, measured at this temperature over the recent copies, that a copy is accepted up to k,
and T(k) the measured step over k tokens (on a CPU the first token adds far more than the next:
20% of a step on the default target; never taken below the fit's slope, as lengths not yet
measured come from the fit). One copy in COPY_PROBE verifies one token past those (the first,
where none earns its cost), so that copies stay measured where they start to survive longer
(every copy doing so would pay for a token that seldom earns its cost). A position few recent
copies reached is judged as the one before it: how far a copy survives depends on the text (an
extraction quotes its source whole, a summary seldom a phrase), and counts left from other
text made copies that fail at their first token run 4-8 tokens long at 1.0
(docs/measurements.md).

The costs are measured as decoding goes (moving averages), so the rule follows the hardware:
a draft on its own unit (c_d hidden) drafts long windows, one that shares the target's cores
short ones.

That rule still pays one draft forward per step to learn that a window is empty, and where the
draft is rarely right (a hot temperature, text unlike what it learnt) every step pays it. So
whether to draft at all is decided per sampling temperature from what drafting steps have
actually earned there: the tokens each committed times t_1 over what it cost (t_1, c_v per
token it verified, and its drafting on the critical path; 1 is what target-only decoding
earns). Below that, steps stop drafting (they cost what an AR step costs,
and only copies from the context, which are free, are still tried) for a pause that doubles
each time a probe of a few drafting steps finds it still does not pay; where it pays again
drafting stays on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LONGEST = 10  # the longest window: verification stops being nearly free beyond it on a CPU
FIRST_THRESHOLD = 0.1  # before anything is measured: a draft at ~5% of a step, c_v about as much
EMA = 0.1
PROBE = 8  # drafting steps measured before drafting may be switched off, and after each pause
FIRST_PAUSE = 16  # steps without drafting after the first switch-off; doubled after each probe
MAX_PAUSE = 512
PAYS = 1.0  # earnings (target-only decoding = 1) below which drafting is switched off
# Copies' acceptance at each window position is counted with this decay per copy verified
# (about the last 20 copies count); a position fewer than COPY_SEEN recent copies reached is
# filled up to that weight with the estimate at the position before (at the first, COPY_PRIOR).
COPY_DECAY = 0.95
COPY_SEEN = 2.0
COPY_PRIOR = 0.9
COPY_PROBE = 8


@dataclass
class Gate:
    """Whether drafting pays at one sampling temperature (see the module's docstring)."""

    earns: float | None = None  # running (committed tokens * t_1 / step seconds)
    measured: int = 0  # drafting steps measured since drafting was last switched on
    pause: int = FIRST_PAUSE
    off_for: int = 0  # steps left without drafting
    # Copies from the context, by window position: decayed counts of copies verified up to
    # there (reached it: every token before it accepted) and accepted there.
    copy_hits: list[float] = field(default_factory=lambda: [0.0] * LONGEST)
    copy_tries: list[float] = field(default_factory=lambda: [0.0] * LONGEST)
    copies_probed: int = 0  # copies asked for since the last one verified past those that pay

    def copy_acceptance(self) -> list[float]:
        """The chance that copied token k is accepted where those before it were, k = 1, 2, ..."""
        out, p = [], COPY_PRIOR
        for hits, tries in zip(self.copy_hits, self.copy_tries):
            p = (hits + max(0.0, COPY_SEEN - tries) * p) / max(tries, COPY_SEEN)
            out.append(p)
        return out


@dataclass
class DraftLength:
    longest: int = LONGEST
    draft_s: float = 0.0  # seconds per draft forward (a job's work over its forwards)
    target_s: dict[int, float] = field(default_factory=dict)  # step seconds by window drafts
    chosen: dict[int, int] = field(default_factory=dict)  # windows verified, by length
    gates: dict[float, Gate] = field(default_factory=dict)  # by sampling temperature

    def gate(self, temperature: float) -> Gate:
        return self.gates.setdefault(round(temperature, 2), Gate())

    def drafting(self, temperature: float) -> bool:
        """Whether this step drafts (False: only free copies from the context)."""
        gate = self.gate(temperature)
        if gate.off_for:
            gate.off_for -= 1
            if not gate.off_for:
                gate.measured, gate.earns = 0, None  # a probe: measure drafting afresh
            return False
        return True

    def record_step(self, temperature: float, committed: int, drafted: int,
                    draft_s: float) -> None:
        """A drafting step verified `drafted` tokens, committed `committed` and spent
        `draft_s` seconds drafting on its critical path. Its cost is priced with the measured
        target step over as many drafts (`verify_s`), which a single step's noisy time is not."""
        if not self.target_s:
            return
        gate = self.gate(temperature)
        earned = committed * self.verify_s(0) / (self.verify_s(drafted) + draft_s)
        gate.measured += 1
        # A probe's mean, then a running average.
        weight = max(EMA, 1 / gate.measured)
        gate.earns = earned if gate.earns is None else (1 - weight) * gate.earns + weight * earned
        if gate.measured < PROBE:
            return
        if gate.earns < PAYS:
            gate.off_for, gate.measured = gate.pause, 0
            gate.pause = min(2 * gate.pause, MAX_PAUSE)
        elif gate.measured == PROBE:
            gate.pause = FIRST_PAUSE  # it pays again: the next switch-off starts short

    def longest_copy(self, temperature: float) -> int:
        """The most tokens a copy from the context may verify at this temperature."""
        if not self.target_s:
            return self.longest
        gate, t1 = self.gate(temperature), self.verify_s(0)
        slope = self._fit()[1]
        survives, k = 1.0, 0
        for n, p in enumerate(gate.copy_acceptance()[: self.longest], 1):
            survives *= p
            if survives * t1 <= max(slope, self.verify_s(n) - self.verify_s(n - 1)):
                break
            k = n
        gate.copies_probed = (gate.copies_probed + 1) % COPY_PROBE
        return min(self.longest, k + (not gate.copies_probed))

    def record_copy(self, temperature: float, verified: int, accepted: int) -> None:
        """A copy of `verified` tokens had its first `accepted` accepted."""
        gate = self.gate(temperature)
        for k in range(LONGEST):
            reached = k < min(verified, accepted + 1)
            gate.copy_tries[k] = COPY_DECAY * gate.copy_tries[k] + reached
            gate.copy_hits[k] = COPY_DECAY * gate.copy_hits[k] + (reached and k < accepted)

    def verify_s(self, drafted: int) -> float:
        """A target step over `drafted` drafts: its running average where steps of that length
        have been measured, else the fit. A CPU's cost is far from linear in the window (on
        the default target: a 1-token step 49 ms, 2 tokens 59, 3 72, 5 78, 11 114), so a line
        through the lengths would overstate t_1 and understate what the first draft adds."""
        if drafted in self.target_s:
            return self.target_s[drafted]
        t1, slope = self._fit()
        return t1 + slope * drafted

    def threshold(self) -> float:
        """The least confidence a_k at which drafting token k still pays."""
        if not self.draft_s or not self.target_s:
            return FIRST_THRESHOLD
        t1, slope = self._fit()
        return min(0.95, max(0.0, (self.draft_s + slope) / t1))

    def _fit(self) -> tuple[float, float]:
        """(t_1, c_v): a target step over one token, and what each drafted token adds."""
        lengths = sorted(self.target_s)
        times = [self.target_s[n] for n in lengths]
        if len(lengths) == 1:
            slope = 0.01 * times[0]  # the little a CPU's verification adds per token
        else:
            mean_n = sum(lengths) / len(lengths)
            mean_t = sum(times) / len(times)
            cov = sum((n - mean_n) * (t - mean_t) for n, t in zip(lengths, times))
            var = sum((n - mean_n) ** 2 for n in lengths)
            slope = max(0.0, cov / var)
        t1 = max(1e-6, sum(times) / len(times) - slope * (sum(lengths) / len(lengths)))
        return t1, slope

    def record_draft(self, seconds: float, forwards: int) -> None:
        if forwards:
            per = seconds / forwards
            self.draft_s = per if not self.draft_s else (1 - EMA) * self.draft_s + EMA * per

    def record_target(self, seconds: float, drafted: int) -> None:
        old = self.target_s.get(drafted)
        self.target_s[drafted] = seconds if old is None else (1 - EMA) * old + EMA * seconds
        self.chosen[drafted] = self.chosen.get(drafted, 0) + 1
