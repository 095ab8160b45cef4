"""At most once under any failure of any Redis call (issue 15, item 2): a property test over random failure points.

Every Redis call of the coordinator's :class:`CommandBus` and of the ranks' :class:`CommandReceiver` goes through
:class:`faultproxy.FaultProxy` in front of a real redis-server, which fails or delays random calls: a broken
connection before the call or after it ran (reply lost), ``-OOM``, ``-MISCONF``, ``-READONLY``, a delay, a stall
past the socket timeout (the call may run after the client gave up and retried), and a SIGKILL of the supervised
redis-server (append-only file, ``appendfsync always``). redis-py's own retries run as in a real run (a short retry budget here, so
that failures also reach our code). The coordinator sends each command until one send succeeds (a failed send is
sent again with the same id, as the coordinator does) and waits for its acks; the ranks loop like
:meth:`CommandReceiver.run`. Then:

- every command is applied exactly once on every target rank (the handler's own ledger, kept outside Redis);
- every target's ack arrives, ``ok``, carrying the result of that one application (a replayed ack carries it too).

``DR_FAULT_EXAMPLES`` sets the number of examples (default 25); the totals (calls, failure points, commands,
duplicates) are printed as one JSON line (``pytest -s``) for the report.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynaresize.control.commands import CommandBus, CommandReceiver
from dynaresize.control.config import RedisConfig
from dynaresize.control.server import RedisServer, connect
from dynaresize.contract.protocol import CommandKind
from faultproxy import FaultProxy, Plan

pytestmark = [pytest.mark.contract, pytest.mark.timeout(900)]

RANKS = 3
EXAMPLES = int(os.environ.get("DR_FAULT_EXAMPLES", "25"))


def _cfg(redis_binary: str) -> RedisConfig:
    return RedisConfig(server_binary=redis_binary, heartbeat_s=0.2, dead_after_heartbeats=2, socket_timeout_s=0.5,
                       connect_timeout_s=0.5, block_ms=50, retries=2, health_check_s=0,
                       write_wait_s=0)  # refusals reach our code at once (the harder case)


def _sigkill(srv: RedisServer) -> None:
    proc = srv.proc
    if proc is None or proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    deadline = time.monotonic() + 15
    while srv.proc is proc and time.monotonic() < deadline:  # the watchdog starts a new process
        time.sleep(0.01)


def _until(what: str, fn, budget: int = 400):
    """Call ``fn`` until it returns without a Redis error (what a real caller's loop does)."""
    for _ in range(budget):
        try:
            return fn()
        except redis.RedisError:
            time.sleep(0.005)
    raise AssertionError(f"{what}: still failing after {budget} attempts")


def run_example(srv: RedisServer, tmp: Path, cfg: RedisConfig, job: str, commands: list[list[int]], seed: int,
                rate: float, totals: Counter) -> None:
    plan = Plan(random_rate=rate, rng=random.Random(seed),
                actions=("drop", "lose", "lose", "oom", "misconf", "readonly", "delay", "restart", "stall"),
                delay_s=0.02, stall_s=cfg.socket_timeout_s + 0.2)
    restarts = Counter()

    def restart() -> None:
        if restarts["n"] < 2:  # a restart costs ~0.1 s: at most two per example
            restarts["n"] += 1
            _sigkill(srv)

    applied: Counter[tuple[int, str]] = Counter()
    results: dict[tuple[int, str], dict] = {}

    def handler_for(rank: int):
        def handle(cmd):
            key = (rank, cmd.command_id)
            applied[key] += 1
            results[key] = {"rank": rank, "n": cmd.payload["n"], "nonce": random.random()}
            return results[key]
        return handle

    with FaultProxy(srv.endpoint_file, tmp / job, plan, on_restart=restart) as proxy:
        plain = connect(srv.endpoint_file, "setup", cfg)  # set-up without faults: the epoch
        bus = CommandBus(connect(proxy.endpoint_file, "coord", cfg), job, cfg, epoch=int(plain.incr(f"dr:{job}:epoch")))
        recvs = {r: _until("receiver start", lambda r=r: CommandReceiver(connect(proxy.endpoint_file, f"rank{r}", cfg),
                                                                          job, r, cfg, incarnation=1, wake=False))
                 for r in range(RANKS)}
        sent = []
        for i, targets in enumerate(commands):
            cmd = bus.command(CommandKind.PING, targets, {"n": i})
            _until("send", lambda: bus.resend(cmd))
            sent.append(cmd)
            acks: dict = {}
            for _ in range(400):
                for r in targets:
                    try:
                        recvs[r].process(handler_for(r))
                    except redis.RedisError:
                        pass  # CommandReceiver.run: logged, retried
                try:
                    got = bus.await_acks(cmd.command_id, targets, timeout=0.05)
                    acks.update(got.acks)
                except redis.RedisError:
                    pass
                if all(r in acks for r in targets):
                    break
            missing = [r for r in targets if r not in acks]
            assert not missing, f"command {i} ({cmd.command_id}): no ack from ranks {missing}; faults {proxy.log[-20:]}"
            for r, ack in acks.items():
                assert ack.ok, f"command {i} rank {r}: {ack.error}; faults {proxy.log[-20:]}"
                assert ack.result == results[(r, cmd.command_id)], f"command {i} rank {r}: ack does not carry the applied result"
        for r in recvs.values():
            r.r.close()
        bus.r.close()
        plain.close()
    dupes = {k: n for k, n in applied.items() if n > 1}
    want = {(r, c.command_id) for c, t in zip(sent, commands) for r in t}
    totals["examples"] += 1
    totals["commands"] += len(commands)
    totals["applications_expected"] += len(want)
    totals["calls"] += proxy.calls
    totals["failure_points"] += sum(proxy.seen.values())
    for a, n in proxy.seen.items():
        totals[f"fault_{a}"] += n
    totals["duplicates"] += sum(n - 1 for n in dupes.values())
    totals["lost"] += len(want - set(applied))
    assert not dupes, f"applied more than once: {dupes}; faults {proxy.log}"
    assert set(applied) == want, f"never applied: {want - set(applied)}"


@pytest.mark.parametrize("fanout", ["per_rank", "broadcast"])
def test_every_command_applied_exactly_once_and_acked_under_random_redis_failures(tmp_path, redis_binary, fanout):
    # broadcast: a command for 2 or more ranks goes to the job's broadcast stream, one for 1 rank to its own stream
    cfg = _cfg(redis_binary).model_copy(update={"broadcast_min_ranks": 0 if fanout == "per_rank" else 2})
    totals: Counter = Counter()
    with RedisServer(cfg, tmp_path / "run", supervise=True) as srv:
        counter = iter(range(10**9))

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
        @given(commands=st.lists(st.lists(st.integers(0, RANKS - 1), min_size=1, max_size=RANKS, unique=True),
                                 min_size=1, max_size=6),
               seed=st.integers(0, 2**32 - 1), rate=st.sampled_from([0.1, 0.2, 0.35]))
        def prop(commands, seed, rate):
            run_example(srv, tmp_path, cfg, f"amo-{next(counter)}", commands, seed, rate, totals)

        prop()
    print(f"\nat-most-once under faults ({fanout}):", json.dumps(dict(sorted(totals.items()))))
    assert totals["failure_points"] > EXAMPLES, "the harness must really inject faults"
    assert totals["duplicates"] == 0 and totals["lost"] == 0


@pytest.mark.parametrize("action", ["drop", "lose", "oom", "misconf", "readonly"])
def test_the_commit_failing_twice_never_re_applies(tmp_path, redis_binary, action):
    """The case the issue found: the commit of an applied command fails, and its retry fails again."""
    cfg = _cfg(redis_binary).model_copy(update={"retries": 0})
    with RedisServer(cfg, tmp_path / "run") as srv:
        job = "commit-twice"
        plain = connect(srv.endpoint_file, "setup", cfg)
        bus = CommandBus(plain, job, cfg)
        cmd = bus.send(CommandKind.PING, [0], {"n": 0})
        plan = Plan()
        with FaultProxy(srv.endpoint_file, tmp_path / "p", plan) as proxy:
            recv = CommandReceiver(connect(proxy.endpoint_file, "rank0", cfg), job, 0, cfg, incarnation=1, wake=False)
            calls: list[str] = []

            def handle(c):
                calls.append(c.command_id)
                plan.next_of["MULTI"] = [action, action]  # the commit, and its retry at the next process()
                return {"n": len(calls)}

            for _ in range(3):
                try:
                    recv.process(handle)
                except redis.RedisError:
                    pass
            got = bus.await_acks(cmd.command_id, [0], timeout=5)
            assert calls == [cmd.command_id], f"applied {len(calls)} times; faults {proxy.log}"
            assert got.acks[0].ok and got.acks[0].result == {"n": 1}
            assert proxy.seen[action] >= 2
            recv.r.close()
        plain.close()
