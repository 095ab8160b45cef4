"""Charged links in the sample-level simulator (dynaresize/sim/links.py): a version's delivery depends on who sends
it and how many transfers share the sender's link; the star against the relay."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynaresize.config.loader import load_config
from dynaresize.schedule import Mechanisms
from dynaresize.sim.compare import link_summary, run_samples, setup
from dynaresize.sim.links import Links

ROOT = Path(__file__).resolve().parents[2]


def test_the_star_queues_every_receiver_on_rank_0s_link():
    links = Links(fanout=0, transfer_s=1.0)
    got = sorted(end for r in range(1, 9) for end, _ in links.request(0.0, r, 1))
    assert got == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert links.stats.origin_busy_s == 8.0 and links.stats.most_sends == 8


def test_the_relay_spreads_in_log_time_and_no_link_carries_more_than_the_fanout():
    links = Links(fanout=2, transfer_s=1.0)
    heap = []
    for r in range(1, 65):
        heap += links.request(0.0, r, 1)
    last = 0.0
    while heap:
        heap.sort(key=lambda x: x[0])
        end, tr = heap.pop(0)
        last = max(last, end)
        heap += links.arrived(end, tr)
    assert sorted(links.plan.holders(1)) == list(range(65))
    assert links.stats.most_sends == 2 and links.stats.origin_busy_s == 2.0
    assert last <= 12.0  # ~log_1.62(65) = 8.7 transfer times (the star: 64)


def test_a_rank_that_holds_the_version_gets_it_at_once():
    links = Links(fanout=2, transfer_s=1.0)
    ((end, tr),) = links.request(0.0, 3, 1)
    links.arrived(end, tr)
    assert links.request(5.0, 3, 1) == [(5.0, tr.__class__(1, 3, 3))]


def _world(steps: int, link_model: str):
    cfg = load_config(ROOT / "configs/sim/scale_4096gpu.yaml",
                      [f"sim.steps={steps}", "sim.write_events=false", f"sim.pipeline.link_model={link_model}"])
    return setup(cfg)


@pytest.mark.parametrize("steps", [6])
def test_at_4096_gpus_the_star_is_bound_by_rank_0s_link_and_the_relay_is_not(steps):
    mech = Mechanisms(True, True, False)  # the runtime's mechanisms: continuous rollout, streaming training
    runs = {m: run_samples(_world(steps, m), _world(steps, m).initial, mech, record_versions=True)
            for m in ("free", "star", "relay")}
    star, relay = (link_summary(runs[m], runs["free"]) for m in ("star", "relay"))
    # the star: rank 0's link carries a version per rollout rank (1,024 x 0.33 s), busy most of the run, and the
    # run is far slower than with free links; the relay: two copies per link, delivery in seconds
    assert star["most_copies_sent_by_one_rank"] == 1024 and star["rank0_link_busy"] > 0.8
    assert star["vs_free_links"] < -0.3 and star["delivery_max_s"] > 300
    assert relay["most_copies_sent_by_one_rank"] == 2 and relay["rank0_link_busy"] < 0.01
    assert relay["vs_free_links"] > -0.05 and relay["delivery_max_s"] < 10
    # what is computed does not change: every batch's groups from the same version, whatever the links
    assert runs["star"].versions == runs["relay"].versions == runs["free"].versions
    assert {v for (b, _), v in runs["relay"].versions.items() if b == 3} == {2}
