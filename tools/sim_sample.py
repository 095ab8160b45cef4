"""Where the sample-level simulator spends its time, by sampling its stack (cProfile's per-call cost distorts an engine
made of ~10,000 small calls a step): a thread reads the main thread's frames every ``--interval`` seconds and counts
each function on the stack (inclusive share) and the line it runs (own share).

    .venv/bin/python tools/sim_sample.py --scenario scale_4096gpu --steps 60

A sample lands where the main thread hands over the interpreter lock (at a call or a loop's jump), so a long C loop
(``sorted``, ``list(map(...))``) counts on the line after it or on that line; a function's own ``def`` line is the
cost of calling it. Every mechanism on, no event log (as ``tools/sim_ab.py``).
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import sim_ab  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="scale_4096gpu")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--interval", type=float, default=0.0007, help="seconds between two samples")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--consolidation", action="store_true", help="tail consolidation on too")
    args = ap.parse_args(argv)
    run = sim_ab.runner("dynaresize", args.scenario, args.steps, args.consolidation)
    main_id = threading.main_thread().ident
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    done = threading.Event()
    n = 0

    def sample() -> None:
        nonlocal n
        while not done.is_set():
            time.sleep(args.interval)
            f = sys._current_frames().get(main_id)
            if f is None:
                continue
            n += 1
            own[(Path(f.f_code.co_filename).name, f.f_code.co_name, f.f_lineno)] += 1
            seen = set()
            while f is not None:
                k = (Path(f.f_code.co_filename).name, f.f_code.co_name)
                if k not in seen:
                    incl[k] += 1
                    seen.add(k)
                f = f.f_back

    sys.setswitchinterval(args.interval / 4)  # hand the lock over often enough for the sampler to run
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    c0 = time.process_time()
    run()
    cpu = time.process_time() - c0
    done.set()
    th.join()
    print(f"{args.scenario} x {args.steps} steps: {cpu:.1f} s CPU, {n} samples")
    print("inclusive (the function on the stack):")
    for (f, fn), v in incl.most_common(args.top):
        print(f"  {100 * v / n:5.1f}%  {f}:{fn}")
    print("own (the line running):")
    for (f, fn, line), v in own.most_common(args.top):
        print(f"  {100 * v / n:5.1f}%  {f}:{line} ({fn})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
