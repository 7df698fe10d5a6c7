"""Mirror-SD's scheduler: which plan it chooses from measured step costs, what the hardware
suggests, that a host whose draft shares the target's cores gets the serial schedule, and that
no plan changes the output."""

import argparse
import itertools

from mirror_mlx.api import Engine
from mirror_mlx.cli import _auto_or_int
from mirror_mlx.decode.schedule import (
    FIRST_PROBE,
    PROBE_STEPS,
    SERIAL,
    Plan,
    Scheduler,
    draft_units,
    plans_up_to,
)

import pytest

from tests.prompts import PROMPTS


def play(scheduler: Scheduler, cost: dict[str, float], steps: int,
         tokens: dict[str, int] | None = None) -> list[str]:
    """Run `steps` steps where each plan's step costs what `cost` says and commits what
    `tokens` says (2 by default); the plans played."""
    played = []
    for _ in range(steps):
        i = scheduler.choose()
        name = scheduler.plans[i].name
        played.append(name)
        scheduler.record(i, cost[name], (tokens or {}).get(name, 2))
    return played


def test_the_ladder_of_plans():
    assert [p.name for p in plans_up_to(8)] == ["serial", "early", "early+2", "early+4",
                                                "early+8"]
    assert [p.name for p in plans_up_to(3)] == ["serial", "early", "early+2", "early+3"]
    assert plans_up_to(0) == (SERIAL, Plan(True, 0))


def test_where_work_beside_costs_more_it_stays_serial_and_probes_ever_less():
    s = Scheduler(separate=False, where="shared")
    played = play(s, {"serial": 0.10, "early": 0.15, "early+2": 0.2, "early+4": 0.3,
                      "early+8": 0.4}, 2000)
    assert played[:FIRST_PROBE] == ["serial"] * FIRST_PROBE
    assert set(played) == {"serial", "early"}  # never further than the losing neighbour
    assert played.count("early") < 10 * PROBE_STEPS  # back-off: ever rarer probes
    assert played[-100:].count("serial") >= 100 - PROBE_STEPS
    assert s.explain().startswith("serial: shared; measured per committed token: serial 50 ms")


def test_where_work_beside_pays_it_climbs_to_the_cheapest_plan():
    s = Scheduler(separate=False, where="shared")
    cost = {"serial": 0.10, "early": 0.09, "early+2": 0.07, "early+4": 0.08, "early+8": 0.12}
    played = play(s, cost, 600)
    assert s.plans[s.best].name == "early+2"
    assert played[-50:].count("early+2") >= 50 - PROBE_STEPS


def test_plans_are_chosen_by_committed_tokens_per_second():
    """A plan with cheaper steps that commit fewer tokens loses: serial's 100 ms steps commit
    3 tokens, early's 80 ms steps 2 (its reused windows are shorter)."""
    s = Scheduler(separate=True, where="separate", budget=0)
    assert s.plans[s.choose()].name == "early"
    play(s, {"serial": 0.10, "early": 0.08}, 400, tokens={"serial": 3, "early": 2})
    assert s.plans[s.best] == SERIAL, s.explain()
    s = Scheduler(separate=False, where="shared", budget=0)
    play(s, {"serial": 0.10, "early": 0.12}, 400, tokens={"serial": 2, "early": 3})
    assert s.plans[s.best].name == "early", s.explain()


def test_separate_compute_starts_from_the_full_budget_and_comes_down_when_it_loses():
    s = Scheduler(separate=True, where="separate")
    assert s.plans[s.choose()].name == "early+8"
    play(s, {"serial": 0.10, "early": 0.05, "early+2": 0.06, "early+4": 0.07, "early+8": 0.08},
         1500)
    assert s.plans[s.best].name == "early"


def test_the_serial_plan_is_probed_from_anywhere_on_the_ladder():
    """A plan whose neighbours both cost more is still left for serial when serial is cheaper
    (measured on a host whose 'separate' cores still contend)."""
    s = Scheduler(separate=True, where="separate")
    play(s, {"serial": 0.20, "early": 0.25, "early+2": 0.24, "early+4": 0.22, "early+8": 0.23},
         400)
    assert s.plans[s.best] == SERIAL


def test_a_fixed_budget_is_one_plan():
    s = Scheduler(separate=False, where="shared", fixed=3)
    assert set(play(s, {"early+3": 0.1}, 50)) == {"early+3"}
    assert "fixed" in s.explain()


def test_what_the_hardware_suggests(target):
    with Engine(target, mode="mirror") as engine:
        separate, why = draft_units(engine.drafter)
        assert not separate and "shares the target's compute (cpu)" in why
        assert draft_units(engine.drafter, separate_units=True)[0]

    class OnTheNeuralEngine:
        compute = "coreml"

    assert draft_units(OnTheNeuralEngine())[0]


def test_budget_argument():
    assert _auto_or_int("auto") is None and _auto_or_int("3") == 3
    with pytest.raises(argparse.ArgumentTypeError):
        _auto_or_int("many")


def test_a_host_that_shares_compute_gets_the_serial_schedule(target):
    """On this CPU-only host the draft shares the target's cores: the automatic budget starts
    serial and, having measured the early rollout beside the target, stays there."""
    with Engine(target, mode="mirror", lookup=False) as engine:
        steps = {}
        for prompt in PROMPTS[:3]:
            engine.session.reset()
            stats = engine.generate(prompt, max_tokens=48).stats
            for plan, n in stats.plan_steps.items():
                steps[plan] = steps.get(plan, 0) + n
        scheduler = engine.session.scheduler
    assert scheduler.plans[scheduler.best] == SERIAL, scheduler.explain()
    assert steps["serial"] >= 0.8 * sum(steps.values()), steps
    assert scheduler.cost(1) is not None  # the early rollout was measured, and lost
    assert stats.schedule.startswith("serial: the draft shares the target's compute")


def test_no_plan_changes_the_output(target):
    """Every plan, switched step by step, gives the target's own greedy tokens."""
    reference = Engine(target)
    with Engine(target, mode="mirror") as engine:
        scheduler = engine.session.scheduler
        order = itertools.cycle([0, 3, 1, 2, 4, 2, 0, 1])
        scheduler.choose = lambda: next(order)
        seen = {}
        for prompt in PROMPTS[:3]:
            engine.session.reset()
            result = engine.generate(prompt, max_tokens=40)
            assert result.token_ids == reference.generate(prompt, max_tokens=40).token_ids
            for plan, n in result.stats.plan_steps.items():
                seen[plan] = seen.get(plan, 0) + n
    assert set(seen) == {"serial", "early", "early+2", "early+4", "early+8"}
