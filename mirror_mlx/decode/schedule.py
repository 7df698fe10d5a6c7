"""How much draft work Mirror-SD runs beside the target each step, chosen from what it costs.

Work beside the target is free only where the draft computes on a unit the target does not use
(Core ML on the Neural Engine beside the GPU; an MLX draft on the CPU beside a GPU target).
Where both share the same cores (every MLX device on a CPU-only host), each rollout beside the
target slows the target down, and plain SD's serial schedule is the faster one.

A plan is a level of that work, from none to the most:
  serial     SD's step: draft the window, then verify it with the whole forward;
  early      the same, with the likeliest next window ("all accepted") rolled out beside it;
  early+b    the forward split at the exit layer, and b branch rollouts beside its suffix.
Plans are compared by seconds per committed token, not per step: a plan also decides the next
window (a reused early rollout can be shorter than a fresh one, or drafted from the draft's
own states rather than the target's), so a plan with cheaper steps can commit fewer tokens a
step. A step's cost is measured from the moment its window is ready to the moment the next
one is (the target, the wait for the draft, and the fresh drafting when no rollout was of
use); it is credited with the tokens the next step commits, which verify the window it made.
The scheduler plays the plan that costs least per token and now and then probes a neighbour
or the serial plan, step for step against it on the same stretch of text; a probe that loses
waits twice as long before the next. A trial is decided only when its evidence is clear: the
tokens a step commits swing from 1 to 10 with how much of the text lookup can copy, and a few
steps that happen to meet a copy would otherwise win a trial for a plan that costs three times
as much (measured: trials of 4 steps walked a 2-core host from serial to the full budget, at
3-4x serial's cost per token). So a trial goes on, pair of steps by pair, until the probe is
cheaper or dearer beyond the error of its ratio (jackknifed over the pairs), and a trial that
stays unclear at its longest keeps the current plan. It starts from what the hardware
suggests: serial where the draft shares the target's compute, the full budget where it does
not. Plans only change the schedule, never what is committed.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

AUTO_BUDGET = 8  # the most branches the automatic budget tries
PROBE_STEPS = 12  # fewest steps a probe plays another plan (as many again the current one)
LONGEST_TRIAL = 32  # most steps of a probe; unclear by then, the current plan stays
MARGIN = 0.05  # a probe replaces the current plan only when this much cheaper
ERRORS = 2.0  # how many standard errors of the cost ratio make a trial's evidence clear
FIRST_PROBE = 16  # steps played before a plan's neighbour is first probed
MAX_BACKOFF = 1024
SMOOTHING = 0.2  # weight of the newest step in a plan's running cost


@dataclass(frozen=True)
class Plan:
    early: bool  # roll out the "all accepted" window beside the verification
    branches: int  # branch rollouts beside the target's suffix (0: no split, no exit readout)

    @property
    def name(self) -> str:
        if not self.early:
            return "serial"
        return "early" if not self.branches else f"early+{self.branches}"


SERIAL = Plan(False, 0)


def plans_up_to(budget: int) -> tuple[Plan, ...]:
    """The ladder of plans, from no work beside the target to `budget` branches."""
    ladder = [SERIAL, Plan(True, 0)]
    b = 2
    while b < budget:
        ladder.append(Plan(True, b))
        b *= 2
    if budget:
        ladder.append(Plan(True, budget))
    return tuple(ladder)


class Scheduler:
    """Chooses each step's plan; kept across a session's generations, so what it learned on
    one reply holds for the next. A `fixed` budget pins one plan (early + that many)."""

    def __init__(self, separate: bool, where: str, budget: int = 8, fixed: int | None = None):
        self.where = where  # what the hardware suggested, in words
        self.fixed = fixed
        self.plans = (Plan(True, fixed),) if fixed is not None else plans_up_to(budget)
        self.start = len(self.plans) - 1 if separate or fixed is not None else 0
        self.best = self.start
        self.seconds: list[float | None] = [None] * len(self.plans)  # per step (running)
        self.tokens: list[float | None] = [None] * len(self.plans)  # committed per step
        self.samples = [0] * len(self.plans)
        self.backoff = [FIRST_PROBE] * len(self.plans)
        self.since = 0  # steps since the last probe ended
        self.probe: int | None = None
        # A probe's steps, and the current plan's meanwhile: (seconds, tokens) each.
        self.trial: dict[int, list[tuple[float, int]]] = {}
        # Steps chosen in the trial and not yet recorded (a step is recorded one step late,
        # when the next window is ready): the step before a trial is not one of its steps.
        self.owed: dict[int, int] = {}

    def cost(self, index: int) -> float | None:
        """Seconds per committed token under plan `index`, as measured so far."""
        if self.seconds[index] is None:
            return None
        return self.seconds[index] / max(self.tokens[index], 1e-9)

    def begin(self) -> None:
        """A generation starts: the last step of the one before, chosen and never recorded
        (it ended before the next window was ready), is owed no more, or a trial running on
        would play one plan twice in a row."""
        self.owed = dict.fromkeys(self.owed, 0)

    def restart(self) -> None:
        """Drafting was switched off (it did not pay under the plan played): the steps that
        probe it again play the plan the hardware suggests, where drafting costs least, or a
        dearer plan that switched drafting off could never be left (no drafting steps, no
        probes; measured: a 2-core host stayed on early+2 with drafting off for 25 of 63
        Spec-Bench generations)."""
        self.best, self.probe, self.since = self.start, None, 0
        self.trial, self.owed = {}, {}

    def choose(self) -> int:
        """The index of the plan for the next step (see `plans`)."""
        if self.probe is None and self.samples[self.best] >= PROBE_STEPS:
            # Neighbours, and the serial plan always: the ladder's costs need not be convex
            # (a measured dip at some budget must not hide that no work beside is cheaper).
            due = [i for i in {0, self.best - 1, self.best + 1}
                   if 0 <= i < len(self.plans) and i != self.best
                   and self.since >= self.backoff[i]]
            if due:
                self.probe = min(due, key=lambda i: self.samples[i])
                self.trial = {self.probe: [], self.best: []}
                self.owed = {self.probe: 0, self.best: 0}
        if self.probe is None:
            return self.best
        # A probe alternates with the current plan, so that both meet the same stretch of
        # text (a reply's cost per step swings with how much of it lookup can copy).
        chosen = {i: len(self.trial[i]) + self.owed[i] for i in (self.probe, self.best)}
        index = self.probe if chosen[self.probe] <= chosen[self.best] else self.best
        self.owed[index] += 1
        return index

    def record(self, index: int, seconds: float, tokens: int) -> None:
        """A step played with plan `index` cost `seconds` (window ready to next window ready)
        and made a window of which `tokens` were committed (with the target's own token)."""
        for running, new in ((self.seconds, seconds), (self.tokens, tokens)):
            old = running[index]
            running[index] = new if old is None else old + SMOOTHING * (new - old)
        self.samples[index] += 1
        if self.probe is None or not self.owed.get(index):
            self.since += 1
            return
        self.owed[index] -= 1
        self.trial[index].append((seconds, tokens))
        steps = min(len(t) for t in self.trial.values())
        if steps < PROBE_STEPS:
            return
        ratio, error = cost_ratio(self.trial[self.probe][:steps], self.trial[self.best][:steps])
        wins = ratio + ERRORS * error < 1 - MARGIN
        if not wins and ratio - ERRORS * error < 1 - MARGIN and steps < LONGEST_TRIAL:
            return  # not clear yet: play another pair
        if wins:
            self.backoff[self.best] = FIRST_PROBE
            self.best = self.probe
        else:
            self.backoff[self.probe] = min(2 * self.backoff[self.probe], MAX_BACKOFF)
        self.probe, self.since = None, 0

    def explain(self) -> str:
        """What it chose and why, in one line."""
        if self.fixed is not None:
            return f"{self.plans[0].name} (fixed by --branch-budget {self.fixed})"
        known = ", ".join(f"{p.name} {self.cost(i) * 1e3:.0f} ms"
                          for i, p in enumerate(self.plans) if self.seconds[i] is not None)
        return (f"{self.plans[self.best].name}: {self.where}; measured per committed token: "
                f"{known or 'nothing yet'}")


def cost_ratio(probe: list[tuple[float, int]], base: list[tuple[float, int]]
               ) -> tuple[float, float]:
    """The probe's cost per committed token over the current plan's, on paired steps of a
    trial, and the jackknife standard error of that ratio (each pair left out in turn)."""
    def ratio(pairs):
        p = sum(s for (s, _), _ in pairs) / sum(n for (_, n), _ in pairs)
        b = sum(s for _, (s, _) in pairs) / sum(n for _, (_, n) in pairs)
        return p / b

    pairs = list(zip(probe, base))
    n = len(pairs)
    left_out = [ratio(pairs[:k] + pairs[k + 1:]) for k in range(n)]
    mean = sum(left_out) / n
    error = ((n - 1) / n * sum((r - mean) ** 2 for r in left_out)) ** 0.5
    return ratio(pairs), error


def device_name(device: mx.Device) -> str:
    return "gpu" if device.type == mx.DeviceType.gpu else "cpu"


def draft_units(drafter, separate_units: bool = False) -> tuple[bool, str]:
    """(whether the draft computes on a unit of its own, why), from where the drafter runs
    (its `compute`: "coreml", or "mlx:" and its MLX device) and the target's MLX device."""
    compute = getattr(drafter, "compute", "unknown")
    target = device_name(mx.default_device())
    if compute == "coreml":
        return True, f"the draft runs on the Neural Engine (Core ML), the target on the {target}"
    if compute.startswith("mlx:") and compute[4:] != target:
        return True, f"the draft runs on the {compute[4:]}, the target on the {target}"
    if separate_units:
        return True, "the target and the draft have a core each (--separate-units)"
    return False, f"the draft shares the target's compute ({target})"


def scheduler_for(drafter, budget: int | None, separate_units: bool = False) -> Scheduler:
    """The scheduler of a session: automatic (`budget` None) or pinned to `budget` branches."""
    separate, where = draft_units(drafter, separate_units)
    return Scheduler(separate, where, AUTO_BUDGET, budget)
