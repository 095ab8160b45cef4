"""Weight delivery over gloo on this machine: the star (trainer rank 0 sends a version to every receiver) against the
relay (every rank holding it forwards it, ``dynaresize/schedule/relay.py``), side by side in one run.

    .venv/bin/python tools/bench_weights.py                      # 2, 4, 6, 8 receivers, 64 MB, fan-out 2
    .venv/bin/python tools/bench_weights.py --receivers 2 8 --mb 16 --repeat 1

Per receiver count and mode: one world of 1 + n processes (gloo over loopback, the world group the transport uses,
no other group), every receiver asks for the version at once, and the production code moves it
(:class:`dynaresize.comm.transport.WeightSender` / :class:`~dynaresize.comm.transport.CommFetch`: buckets, the
structure hash, the bytes' checksum; a relay forwards from its second buffer once its own receive is checked). Each
receiver checks it holds rank 0's bytes. Reported: seconds from the start to the last receiver holding the version
(the median of ``--repeat`` versions), and the bytes each rank sent (the most by one rank, and rank 0's). A table,
then ONE JSON line. Targets (issue 46): the relay's most-bytes-sent-by-one-rank stays flat as receivers grow (at
most fan-out x the model), the star's grows linearly (n x the model).

On this machine every process shares two busy cores and loopback has no link to saturate: the times say what the
relay's hops cost here, not what it saves on a network (the simulator prices links: ``dynaresize simulate --compare``,
docs/simulator.md "Weight delivery").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from dynaresize.comm.transport import CommFetch, WeightSender  # noqa: E402
from dynaresize.schedule.relay import RelayPlan  # noqa: E402

BUCKET = 16 << 20


def model(mb: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """``mb`` MB of float32 weights in 8 tensors (rank 0's draw differs from the receivers' own)."""
    g = torch.Generator().manual_seed(seed)
    n = (mb << 20) // 4 // 8
    return [(f"layer{i}.weight", torch.randn(n, generator=g)) for i in range(8)]


def plan(n: int, fanout: int, version: int) -> list:
    p = RelayPlan(0, fanout)
    p.published(version)
    return [t for r in range(1, n + 1) for t in p.ask(r, version)]


def worker(rank: int, world: int, init: str, mb: int, fanout: int, repeat: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mine = model(mb, 1 if rank == 0 else 2)
    sender = WeightSender(BUCKET, "cpu")
    times, sent = [], 0
    for version in range(1, repeat + 1):
        transfers = plan(world - 1, fanout, version)
        src = {t.dst: t.src for t in transfers}
        dsts = [t.dst for t in transfers if t.src == rank]
        dist.barrier()
        t0 = time.time()
        if rank == 0:
            sender.hold(version, mine)
        else:
            fetch = CommFetch(mine, src[rank], version, BUCKET, "cpu")
            if dsts:
                sender.relay(version, fetch, [n for n, _ in mine])
        if dsts:
            sender.push(version, dsts, one_at_a_time=fanout > 0 and rank != 0)  # as the coordinator asks
        end = 0.0
        if rank != 0:
            got, _ = fetch.result()
            end = time.time() - t0
            want = model(mb, 1)
            assert all(torch.equal(got[n], t) for n, t in want), f"rank {rank}: not rank 0's bytes"
        while len(sender.sent) < len(dsts):  # this rank's sends of this version ended
            time.sleep(0.002)
        recs = sender.take_sent()
        errors = [r["error"] for r in recs if "error" in r]
        assert not errors, errors
        sent += sum(r["bytes"] for r in recs)
        ends = [None] * world
        dist.all_gather_object(ends, end)  # (the bench's bookkeeping, not the transport's)
        times.append(max(ends))
    sents = [None] * world
    dist.all_gather_object(sents, sent // repeat)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": statistics.median(times), "sent": sents}))
    dist.barrier()
    dist.destroy_process_group()


def one(n: int, mb: int, fanout: int, repeat: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        mp.spawn(worker, args=(n + 1, f"file://{d}/store", mb, fanout, repeat, out), nprocs=n + 1, join=True)
        res = json.loads(Path(out).read_text())
    size = mb << 20
    return dict(receivers=n, seconds=res["seconds"], most_sent_mb=max(res["sent"]) / (1 << 20),
                rank0_sent_mb=res["sent"][0] / (1 << 20), most_sent_models=max(res["sent"]) / size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--receivers", type=int, nargs="*", default=[2, 4, 6, 8], help="receiving ranks per world (2-8)")
    ap.add_argument("--mb", type=int, default=64, help="model size, MB")
    ap.add_argument("--fanout", type=int, default=2, help="the relay's fan-out (pipeline.weights_relay)")
    ap.add_argument("--repeat", type=int, default=3, help="versions sent per world (the median time is reported)")
    args = ap.parse_args(argv)
    if any(not 1 <= n <= 16 for n in args.receivers) or args.mb < 1 or args.fanout < 1 or args.repeat < 1:
        ap.error("want 1-16 receivers, --mb >= 1, --fanout >= 1, --repeat >= 1")
    rows = []
    for n in args.receivers:
        star, relay = one(n, args.mb, 0, args.repeat), one(n, args.mb, args.fanout, args.repeat)
        rows.append(dict(receivers=n, star=star, relay=relay))
    head = (f"{'receivers':>9} {'star_s':>8} {'relay_s':>8} {'star_most_MB':>12} {'relay_most_MB':>13} "
            f"{'star_rank0_MB':>13} {'relay_rank0_MB':>14}")
    print(f"weights: {args.mb} MB per version, gloo on this machine ({os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}), relay fan-out {args.fanout}, median of {args.repeat} versions")
    print(head)
    print("-" * len(head))
    for r in rows:
        s, l = r["star"], r["relay"]
        print(f"{r['receivers']:>9} {s['seconds']:>8.3f} {l['seconds']:>8.3f} {s['most_sent_mb']:>12.0f} "
              f"{l['most_sent_mb']:>13.0f} {s['rank0_sent_mb']:>13.0f} {l['rank0_sent_mb']:>14.0f}")
    most_relay = [r["relay"]["most_sent_models"] for r in rows]
    most_star = [r["star"]["most_sent_models"] for r in rows]
    print(json.dumps(dict(
        mb=args.mb, fanout=args.fanout, repeat=args.repeat, rows=rows,
        relay_most_sent_flat=max(most_relay) <= args.fanout,
        star_most_sent_linear=all(abs(m - r["receivers"]) < 1e-9 for m, r in zip(most_star, rows)),
    )))
    return 0


if __name__ == "__main__":
    sys.exit(main())
