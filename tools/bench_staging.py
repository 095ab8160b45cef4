"""Staging write throughput against a plain sequential write of the same bytes to the same directory, and the
extra memory staging needs (peak RSS above the state it stages).

    .venv/bin/python tools/bench_staging.py                       # 512 MiB of state, 64 MiB buffer
    .venv/bin/python tools/bench_staging.py --mb 2048 --dir /nvme/tmp --fsync

Both sides write to files in ``--dir`` (default: the system temp dir) without fsync unless ``--fsync`` (then both
fsync). Rounds alternate plain/staging; the best round of each is compared. ``peak_rss_mb`` is the highest RSS
seen during staging minus the RSS before it (the source state is already resident: on a GPU it would be device
memory; what staging adds is the chunk pool). Prints a table, then one JSON line: ratio, peak_rss_mb, buffer_mb.
Targets: ratio >= 0.8, peak_rss_mb <= buffer_mb + 64.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class PeakRss:
    """Samples this process's RSS every few milliseconds on a thread."""

    def __init__(self, period_s: float = 0.005):
        import psutil

        self.proc = psutil.Process()
        self.period = period_s
        self.peak = 0
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.period)

    def __enter__(self) -> "PeakRss":
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._th.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="state size to stage (MiB)")
    ap.add_argument("--buffer-mb", type=int, default=64)
    ap.add_argument("--chunk-mb", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="writer threads")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dir", default=None, help="target directory (default: system temp dir)")
    ap.add_argument("--fsync", action="store_true", help="fsync on both sides")
    ap.add_argument("--checksum", default="auto", choices=["auto", "xxh3", "crc32", "blake2b"])
    ap.add_argument("--copy", action="store_true",
                    help="pass host tensors through the chunk pool too (what device tensors do); default: zero-copy")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from dynaresize.staging import Stager

    work = Path(tempfile.mkdtemp(prefix="bench-staging-", dir=args.dir))
    # a few tensors of an optimizer state (fp32), filled so no page is a shared zero page
    n = (args.mb << 20) // 4
    sizes = [n // 2, n // 4, n - n // 2 - n // 4]
    state = {f"t{i}": torch.arange(s, dtype=torch.float32).mul_(1.0001) for i, s in enumerate(sizes)}
    blob = [t.view(torch.uint8).numpy() for t in state.values()]
    nbytes = sum(b.nbytes for b in blob)
    st = Stager(work, buffer_mb=args.buffer_mb, chunk_mb=args.chunk_mb, writer_threads=args.threads,
                checksum=args.checksum, fsync=args.fsync, zero_copy_host=not args.copy)
    plain_s, stage_s, peaks = [], [], []
    try:
        def run_plain() -> None:
            t = 0.0
            for i, b in enumerate(blob):  # the same bytes, written one tensor after the other, one file
                t0 = time.perf_counter()
                with open(work / "plain.bin", "wb" if i == 0 else "ab", buffering=0) as f:
                    mv = memoryview(b).cast("B")
                    for off in range(0, len(mv), args.chunk_mb << 20):
                        f.write(mv[off:off + (args.chunk_mb << 20)])
                    if args.fsync:
                        os.fsync(f.fileno())
                t += time.perf_counter() - t0
            plain_s.append(t)
            (work / "plain.bin").unlink()

        def run_stage(r: int) -> None:
            with PeakRss() as rss:
                res = st.stage("snap", state, meta={"round": r})
            stage_s.append(res.seconds)
            peaks.append((rss.peak - rss.base) / (1 << 20))
            shutil.rmtree(work / "snap")

        for r in range(args.rounds):  # alternate the order: each side follows the other's write-back equally often
            if r % 2:
                run_stage(r)
                run_plain()
            else:
                run_plain()
                run_stage(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = nbytes / 1e9
    best_plain, best_stage = min(plain_s), min(stage_s)
    ratio = best_plain / best_stage
    peak = max(peaks)
    print(f"{'side':<10} {'best s':>8} {'GB/s':>7}  rounds")
    print(f"{'plain':<10} {best_plain:8.3f} {gb / best_plain:7.2f}  " + " ".join(f"{x:.3f}" for x in plain_s))
    print(f"{'staging':<10} {best_stage:8.3f} {gb / best_stage:7.2f}  " + " ".join(f"{x:.3f}" for x in stage_s))
    print(f"\n{nbytes >> 20} MiB, buffer {st.buffer_bytes >> 20} MiB in {len(st.buffers)} chunks of {st.chunk >> 20} MiB, "
          f"{args.threads} writer thread(s), {st.algo}; staging/plain throughput {ratio:.2f} (target >= 0.8); "
          f"peak extra RSS {peak:.1f} MiB (target <= {args.buffer_mb + 64})")
    print(json.dumps({"ratio": round(ratio, 3), "peak_rss_mb": round(peak, 1), "buffer_mb": args.buffer_mb,
                      "plain_gbps": round(gb / best_plain, 3), "staging_gbps": round(gb / best_stage, 3), "mb": args.mb,
                      "fsync": args.fsync, "checksum": st.algo,
                      "pool_copy": args.copy}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
