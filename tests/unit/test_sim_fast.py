"""The golden check of the sample-level engine (issue 28, item 3): worlds whose runs were recorded in
tests/fixtures/sim_golden.json with the engine and core as they were before the fast engine (commit a6367d7) run
through today's :mod:`dynaresize.sim.samples`, and every recorded value must be identical, bit for bit: the run's end
(the repr of the float), every step's trainer split, the switches and their costs, the busy GPU-seconds, the helps,
and sha256 digests of the sample-to-version map and of the whole event log (every stage interval, decision and switch
op, in order). No tolerance: the fast engine computes the same floating-point operations
in the same order, it only skips Python work whose result is known.

The worlds (tests/support/sim_golden.py): 150 seeded random small worlds, two runs each, and the five scenarios with
four mechanism sets. Regenerate the fixture (``python -m tests.support.sim_golden --write``) only for an
intended change of the simulator's results, and say so in the commit; a failure here otherwise means the engine's
results changed (or a world did: a config under configs/sim, or the generator, which the ``world`` digest catches)."""

from __future__ import annotations

import json

import pytest

from tests.support.sim_golden import FIXTURE, run_world, worlds

pytestmark = pytest.mark.unit

GOLDEN: dict[str, dict] = json.loads(FIXTURE.read_text())
WORLDS = list(worlds())


def test_the_fixture_holds_every_run_of_every_world():
    assert sorted(GOLDEN) == sorted(f"{name}/{run}" for name, _, _, runs in WORLDS for run, _, _ in runs)


@pytest.mark.parametrize("name,config,over,runs", WORLDS, ids=[w[0] for w in WORLDS])
def test_runs_are_identical_to_the_recorded_ones(name, config, over, runs):
    for run, got in run_world(config, over, runs).items():
        want = GOLDEN[f"{name}/{run}"]
        assert got["world"] == want["world"], f"{name}/{run}: not the recorded world (generator?)"
        assert got.keys() == want.keys()
        diff = {k: (want[k], got[k]) for k in want if got[k] != want[k]}
        assert not diff, f"{name}/{run} differs from the recorded run (recorded, now): {diff}"
