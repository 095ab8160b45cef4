"""Chaos soak: N runs of the quickstart, each with a random schedule of faults, each checked against a fault-free
run of the same seed and schedule (issue 27, "What it must show"; docs/FAULTS.md, "The chaos soak").

    .venv/bin/python tools/chaos.py --runs 6 --seed 1                 # ~1-3 min a run on 2 cores
    .venv/bin/python tools/chaos.py --runs 2 --classes kill_rollout,sigterm_all --schedules barrier

Every run is ``dynaresize run configs/quickstart.yaml run.steps=S run.checkpoint_every=4 pipeline.schedule=X``
(the runs alternate the schedules of ``--schedules``), real processes throughout (coordinator, redis-server, 4
worker ranks with DeepSpeed on CPU). From ``--seed`` each run draws 1..``--max-faults`` faults, each at a step,
from the classes the project handles (FAULTS.md rows in brackets):

    kill_rollout   SIGKILL of the highest live rank (a rollout rank: trainer sets are a prefix)  [1, 29]
    freeze_rollout SIGSTOP of that rank past the heartbeat deadline, then SIGCONT               [3, 29]
    kill_coord     SIGKILL of the coordinator, then ``dynaresize run --resume RUN_DIR``          [4]
    second_coord   ``--resume`` while the first coordinator still runs (hung: SIGSTOP until the
                   second one has taken the run over, then SIGCONT)                              [23]
    kill_redis     SIGKILL of the run's redis-server                                             [5]
    redis_refuses  Redis refusing writes a while (CONFIG SET maxmemory 1, then 0)                [13]
    disk_full      the run's filesystem full a while (the output directory on a tmpfs filled by
                   a file, then the file removed); needs root to mount, else skipped, and said  [26-28]
    sigterm_all    SIGTERM to every process of the job, then ``--resume``                        [15]

A fault is injected once the run has trained its step (and one more step since the previous fault or resume);
whenever the job's coordinator is gone and the run is not complete, the tool resumes it as a user would
(``dynaresize run --resume RUN_DIR``, at most ``--resumes`` times). Each finished run is compared with the fault-free
reference run of its schedule (run once, cached under ``--out``): every step once in ``batches.jsonl`` with the
reference's sample keys, and for each key the same policy version and reward, losses within 1e-3 (relative),
no step trained twice beyond what a ``rewind`` event announced (each ``step_end`` in ``events.jsonl`` is one
training of a step), the final checkpoint present, ``summary.json`` ``completed``.

Prints one row per run (schedule, faults injected, outcome, lost_or_doubled, steps_retrained, wall s), then ONE
JSON line: runs, faults, completed, lost_or_doubled (target 0), steps_retrained, plus details.
Fault injection lives here (and in tests/), never in ``dynaresize/``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.procs import children  # noqa: E402 - the process tree, as the fault tests read it

CLASSES = ["kill_rollout", "freeze_rollout", "kill_coord", "second_coord", "kill_redis", "redis_refuses",
           "disk_full", "sigterm_all"]
SCHEDULES = ["barrier_free", "barrier"]
DEAD_AFTER_S = 5.0  # the quickstart's heartbeat deadline (redis.heartbeat_s 1 x dead_after_heartbeats 5)
LOSS_REL = 1e-3


# --- reading a run directory (no fault injection here: usable by tests too) --------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSON-lines file; a line cut by a hard stop is skipped."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def n_lines(path: Path) -> int:
    try:
        return len(path.read_text(errors="replace").splitlines())
    except OSError:
        return 0


def controls(run_dir: Path, what: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("type") == "control" and e.get("what") == what]


REWIND = re.compile(r"steps (\d+)\.\.(\d+) ran after the last checkpoint")


def check_run(run_dir: Path, ref_dir: Path, steps: int) -> dict:
    """A run against the fault-free reference of its seed and schedule. ``lost_or_doubled``: steps missing or
    recorded twice in ``batches.jsonl``, steps whose sample keys differ from the reference's (a sample lost or
    duplicated), and trainings of a step beyond the one a ``rewind`` announced; ``diverged``: steps with the
    reference's keys but another version, reward or loss; ``steps_retrained``: trainings beyond the first."""
    problems: list[str] = []
    got = read_jsonl(run_dir / "batches.jsonl")
    want = {b["step"]: b for b in read_jsonl(ref_dir / "batches.jsonl")}
    by_step: dict[int, list[dict]] = {}
    for b in got:
        by_step.setdefault(b.get("step"), []).append(b)
    lost_or_doubled, diverged, max_loss_diff = 0, 0, 0.0
    for k in range(steps):
        recs = by_step.get(k, [])
        if len(recs) != 1:
            lost_or_doubled += 1
            problems.append(f"step {k}: {len(recs)} records in batches.jsonl")
            continue
        g, w = recs[0], want.get(k)
        if w is None:
            problems.append(f"step {k}: not in the reference")
            diverged += 1
            continue
        if sorted(g["keys"]) != sorted(w["keys"]) or len(set(g["keys"])) != len(g["keys"]):
            lost_or_doubled += 1
            problems.append(f"step {k}: sample keys differ ({len(g['keys'])} vs {len(w['keys'])})")
            continue
        gv, wv = dict(zip(g["keys"], g["versions"])), dict(zip(w["keys"], w["versions"]))
        gr, wr = dict(zip(g["keys"], g["rewards"])), dict(zip(w["keys"], w["rewards"]))
        d = abs(g["loss"] - w["loss"])
        max_loss_diff = max(max_loss_diff, d)
        bad = [what for what, ok in (("versions", gv == wv), ("rewards", gr == wr),
                                     ("loss", d <= max(LOSS_REL * abs(w["loss"]), 1e-5))) if not ok]
        if bad:
            diverged += 1
            problems.append(f"step {k}: {', '.join(bad)} differ (loss {g['loss']:.6g} vs {w['loss']:.6g})")
    extra = sorted(s for s in by_step if not isinstance(s, int) or not 0 <= s < steps)
    if extra:
        lost_or_doubled += len(extra)
        problems.append(f"steps outside 0..{steps - 1} recorded: {extra}")

    events = read_jsonl(run_dir / "events.jsonl")
    trained: dict[int, int] = {}
    for e in events:
        if e.get("type") == "step_end":
            trained[e["step"]] = trained.get(e["step"], 0) + 1
    announced: dict[int, int] = {}
    for e in events:
        if e.get("type") == "control" and e.get("what") == "rewind":
            m = REWIND.search(e.get("reason", ""))
            if m:
                for s in range(int(m.group(1)), int(m.group(2)) + 1):
                    announced[s] = announced.get(s, 0) + 1
    retrained = sum(max(0, n - 1) for n in trained.values())
    unannounced = {s: n - 1 - announced.get(s, 0) for s, n in trained.items() if n - 1 > announced.get(s, 0)}
    if unannounced:
        lost_or_doubled += sum(unannounced.values())
        problems.append(f"trained again without a rewind announcing it: steps {sorted(unannounced)}")
    missing = [k for k in range(steps) if k not in trained]
    if missing:
        problems.append(f"no step_end for steps {missing}")

    summary = {}
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    status = summary.get("status", "none")
    ends = [e for e in events if e.get("type") == "run_end"]
    final_ckpt = any(p.is_dir() for p in (run_dir / "checkpoints").glob(f"step-{steps}*")) if (run_dir / "checkpoints").is_dir() else False
    try:
        state_step = json.loads((run_dir / "checkpoints" / "coordinator.json").read_text()).get("step")
    except (OSError, ValueError):
        state_step = None
    if not final_ckpt or state_step != steps:
        problems.append(f"final checkpoint: step-{steps} {'present' if final_ckpt else 'missing'}, coordinator.json step {state_step}")
    if status != "completed":
        problems.append(f"summary status {status}")
    return {"completed": status == "completed" and bool(ends) and ends[-1].get("status") == "completed",
            "final_checkpoint": final_ckpt and state_step == steps, "lost_or_doubled": lost_or_doubled,
            "diverged": diverged, "steps_retrained": retrained, "rewinds": len(controls(run_dir, "rewind")),
            "max_loss_diff": max_loss_diff, "problems": problems}


# --- processes -----------------------------------------------------------------------------------------------------


def descendants(root: int) -> set[int]:
    kids, out, todo = children(), set(), [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo += kids.get(pid, [])
    return out


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def signal_pid(pid: int | None, sig: int) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def rank_pids(run_dir: Path) -> dict[int, int]:
    try:
        return {int(r): int(reg["pid"]) for r, reg in json.loads((run_dir / "ranks.json").read_text()).items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def redis_admin(run_dir: Path):
    from dynaresize.control.server import connect

    return connect(run_dir / "redis" / "redis.json", role="chaos")


def redis_pid(run_dir: Path) -> int | None:
    try:
        c = redis_admin(run_dir)
        try:
            return int(c.info("server")["process_id"])
        finally:
            c.close()
    except Exception:  # noqa: BLE001 - Redis down or not started
        return None


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# --- one run -------------------------------------------------------------------------------------------------------
@dataclass
class Job:
    """The runs of one run directory: its coordinators (the first start, then resumes), the processes seen."""
    parent: Path
    argv_base: list[str]
    env: dict
    logs: Path
    coords: list[subprocess.Popen] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    run_dir: Path | None = None
    notes: list[str] = field(default_factory=list)

    def _spawn(self, argv: list[str]) -> subprocess.Popen:
        n = len(self.coords)
        log = open(self.logs / f"coordinator-{n}.log", "w")
        p = subprocess.Popen([sys.executable, "-m", "dynaresize.cli", "run", *argv, "--quiet"], cwd=ROOT, env=self.env,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.coords.append(p)
        self.seen.add(p.pid)
        return p

    def start(self, overrides: list[str]) -> None:
        self._spawn(["configs/quickstart.yaml", *overrides])

    def resume(self) -> subprocess.Popen:
        assert self.run_dir is not None
        return self._spawn(["--resume", str(self.run_dir)])

    def live(self) -> list[subprocess.Popen]:
        return [p for p in self.coords if p.poll() is None]

    def find_run_dir(self) -> Path | None:
        if self.run_dir is None and self.parent.exists():
            dirs = [d for d in self.parent.iterdir() if d.is_dir() and (d / ".dynaresize-run.json").exists()]
            self.run_dir = dirs[0] if len(dirs) == 1 else None
        return self.run_dir

    def processes(self) -> set[int]:
        """Every live process of the job: the coordinators and their descendants, the ranks of ranks.json, Redis."""
        pids: set[int] = set()
        for p in self.live():
            pids |= descendants(p.pid)
        if self.run_dir is not None:
            for pid in rank_pids(self.run_dir).values():
                if alive(pid):
                    pids |= descendants(pid)
        self.seen |= pids
        return {p for p in pids if alive(p)}

    def cleanup(self) -> list[int]:
        """Kills (by pid) whatever of the job outlived it: processes this tool started or saw as the job's."""
        self.processes()
        left = []
        for pid in sorted(self.seen):
            if alive(pid) and (str(self.parent) in cmdline(pid) or pid in {p.pid for p in self.coords}
                               or "dynaresize" in cmdline(pid) or "redis-server" in cmdline(pid)):
                left.append(pid)
                signal_pid(pid, signal.SIGCONT)
                signal_pid(pid, signal.SIGKILL)
        for p in self.coords:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        return left


def summary_status(run_dir: Path) -> str:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status", "none")
    except (OSError, ValueError, AttributeError):
        return "none"


def step_ends(run_dir: Path) -> int:
    return sum(1 for e in read_jsonl(run_dir / "events.jsonl") if e.get("type") == "step_end")


class Injector:
    """The faults of one run. Each ``inject_*`` returns what it did (a short text) or None when it could not apply."""

    def __init__(self, job: Job, fs_root: Path | None):
        self.job = job
        self.fs_root = fs_root  # the tmpfs holding the output directory (disk_full), if mounted

    def _target_rank(self) -> tuple[int, int] | None:
        pids = rank_pids(self.job.run_dir)
        live = sorted(r for r, pid in pids.items() if alive(pid) and r >= 2)
        return (live[-1], pids[live[-1]]) if live else None

    def kill_rollout(self, wait):
        t = self._target_rank()
        if t is None:
            return None
        signal_pid(t[1], signal.SIGKILL)
        return f"SIGKILL rank {t[0]}"

    def freeze_rollout(self, wait):
        t = self._target_rank()
        if t is None:
            return None
        signal_pid(t[1], signal.SIGSTOP)
        try:
            wait(DEAD_AFTER_S + 3.0)
        finally:
            signal_pid(t[1], signal.SIGCONT)
        return f"SIGSTOP rank {t[0]} {DEAD_AFTER_S + 3:.0f}s, SIGCONT"

    def kill_coord(self, wait):
        live = self.job.live()
        if not live:
            return None
        for p in live:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the coordinator's own session: ranks and Redis run in theirs
            except ProcessLookupError:
                pass
            p.wait()
        return "SIGKILL coordinator"

    def second_coord(self, wait):
        live = self.job.live()
        if not live:
            return None
        first = live[-1]
        signal_pid(first.pid, signal.SIGSTOP)  # hung: else a 5 s run ends before the second one has started
        try:
            n0 = len(controls(self.job.run_dir, "resume")) + len(controls(self.job.run_dir, "attach"))
            second = self.job.resume()
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and second.poll() is None:
                if len(controls(self.job.run_dir, "resume")) + len(controls(self.job.run_dir, "attach")) > n0:
                    break
                time.sleep(0.1)
            time.sleep(1.0)
        finally:
            signal_pid(first.pid, signal.SIGCONT)
        return f"--resume while pid {first.pid} hung (SIGSTOP, then SIGCONT)"

    def kill_redis(self, wait):
        pid = redis_pid(self.job.run_dir)
        if pid is None:
            return None
        signal_pid(pid, signal.SIGKILL)
        return f"SIGKILL redis-server {pid}"

    def redis_refuses(self, wait):
        try:
            admin = redis_admin(self.job.run_dir)
            admin.config_set("maxmemory", 1)
        except Exception:  # noqa: BLE001
            return None
        try:
            wait(4.0)
        finally:
            try:
                admin.config_set("maxmemory", 0)
            except Exception as e:  # noqa: BLE001 - the run may have stopped with its server
                self.job.notes.append(f"could not restore maxmemory: {e}")
            admin.close()
        return "maxmemory 1 for 4s"

    def disk_full(self, wait):
        if self.fs_root is None:
            return None
        filler = self.fs_root / "filler"
        try:
            with open(filler, "wb") as f:
                f.write(b"\0" * max(0, free_bytes(self.fs_root) - (32 << 10)))
        except OSError:
            pass  # full before the end of the filler: fine
        try:
            wait(6.0)
        finally:
            filler.unlink(missing_ok=True)
        return "disk full 6s"

    def sigterm_all(self, wait):
        pids = self.job.processes()
        if not pids:
            return None
        for pid in pids:
            signal_pid(pid, signal.SIGTERM)
        return f"SIGTERM to {len(pids)} processes"


def mount_tmpfs(path: Path, size: int) -> str | None:
    """None when mounted, else why not."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                           capture_output=True, text=True)
    except FileNotFoundError:
        return "no mount command"
    return (r.stderr or r.stdout).strip() or f"mount exit {r.returncode}" if r.returncode else None


def unmount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def run_once(workdir: Path, overrides: list[str], faults: list[tuple[str, int]], env: dict, resumes: int,
             timeout_s: float, disk: bool) -> dict:
    """One run (a fresh start, its faults, its resumes) in ``workdir``; returns what happened. The run directory is
    ``workdir/runs/<name>-<time>``; with ``disk`` the ``runs`` folder is a tmpfs, copied out at the end."""
    workdir.mkdir(parents=True, exist_ok=True)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    parent = workdir / "runs"
    fs_root = None
    if disk:
        why = mount_tmpfs(parent, 256 << 20)
        if why is None:
            fs_root = parent
    job = Job(parent, overrides, env, logs)
    inj = Injector(job, fs_root)
    t0 = time.monotonic()
    injected: list[str] = []
    pending = list(faults)
    resumed = 0
    outcome = None
    job.start([*overrides, f"run.output_dir={parent}"])
    last_mark = 0  # step_end count at the last fault or resume: the next fault waits for a step after it

    def wait(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            job.processes()
            time.sleep(0.1)

    try:
        while True:
            if time.monotonic() - t0 > timeout_s:
                outcome = f"timeout {timeout_s:.0f}s"
                break
            rd = job.find_run_dir()
            if not job.live():
                if rd is not None and summary_status(rd) == "completed":
                    break
                if rd is None or resumed >= resumes:
                    outcome = f"not completed after {resumed} resume(s)"
                    break
                if fs_root is not None:
                    (fs_root / "filler").unlink(missing_ok=True)
                job.resume()
                resumed += 1
                last_mark = step_ends(rd)
                continue
            if rd is not None and pending:
                done, ends = n_lines(rd / "batches.jsonl"), step_ends(rd)
                name, at = pending[0]
                if done >= at and ends > last_mark:
                    pending.pop(0)
                    what = getattr(inj, name)(wait)
                    if what is not None:
                        injected.append(f"{name}@{done}")
                        job.notes.append(f"{name} after {done} steps: {what}")
                    last_mark = step_ends(rd)
            job.processes()
            time.sleep(0.05)
    finally:
        strays = job.cleanup()
        if strays:
            job.notes.append(f"killed {len(strays)} leftover process(es): {strays}")
        if fs_root is not None and job.run_dir is not None:
            keep = workdir / "run"
            shutil.copytree(job.run_dir, keep, ignore=shutil.ignore_patterns("checkpoints", "weights", "redis"),
                            dirs_exist_ok=True)
            ck = job.run_dir / "checkpoints"  # the names of the checkpoints and the resume point: what check_run reads
            (keep / "checkpoints").mkdir(exist_ok=True)
            if ck.is_dir():
                for c in ck.iterdir():
                    if c.is_dir():
                        (keep / "checkpoints" / c.name).mkdir(exist_ok=True)
                    elif c.name == "coordinator.json":
                        shutil.copy(c, keep / "checkpoints" / c.name)
            unmount(parent)
            job.run_dir = keep
    return {"run_dir": job.run_dir, "injected": injected, "not_injected": [f"{n}@{a}" for n, a in pending],
            "resumes": resumed, "outcome": outcome, "wall_s": time.monotonic() - t0, "notes": job.notes,
            "exit_codes": [p.returncode for p in job.coords]}


def reference(out: Path, schedule: str, overrides: list[str], env: dict, timeout_s: float) -> Path:
    """The fault-free run of this schedule and seed, run once and kept under ``out/refs``."""
    key = re.sub(r"[^A-Za-z0-9._=-]", "_", "-".join([schedule, *overrides]))[:150]
    home = out / "refs" / key
    done = home / "done.json"
    if done.exists():
        rd = Path(json.loads(done.read_text())["run_dir"])
        if (rd / "batches.jsonl").exists():
            return rd
    shutil.rmtree(home, ignore_errors=True)
    r = run_once(home, overrides, [], env, resumes=0, timeout_s=timeout_s, disk=False)
    rd = r["run_dir"]
    if r["outcome"] is not None or rd is None:
        raise SystemExit(f"chaos: the fault-free reference run ({schedule}) did not complete: {r['outcome']}; "
                         f"see {home / 'logs'}")
    done.write_text(json.dumps({"run_dir": str(rd)}))
    return rd


def draw(rng: random.Random, classes: list[str], max_faults: int, steps: int) -> list[tuple[str, int]]:
    n = rng.randint(1, max_faults)
    hi = max(2, steps - 4)
    return sorted(((rng.choice(classes), rng.randint(1, hi)) for _ in range(n)), key=lambda f: f[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=6, help="faulted runs (default 6)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fault schedules (default 0)")
    ap.add_argument("--job-seed", type=int, default=0, help="run.seed of every run and reference (default 0)")
    ap.add_argument("--steps", type=int, default=16, help="run.steps (default 16)")
    ap.add_argument("--checkpoint-every", type=int, default=4, help="run.checkpoint_every (default 4)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="pipeline.schedule values the runs alternate")
    ap.add_argument("--classes", default=",".join(CLASSES), help="fault classes to draw from")
    ap.add_argument("--max-faults", type=int, default=2, help="most faults in one run (default 2)")
    ap.add_argument("--resumes", type=int, default=4, help="most `--resume`s of one run (default 4)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a run may take in all (default 600)")
    ap.add_argument("--out", default="runs/chaos", help="working directory (references cached here)")
    ap.add_argument("--set", action="append", default=[], metavar="K=V", help="extra override for every run")
    args = ap.parse_args(argv)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    schedules = [s for s in args.schedules.split(",") if s]
    classes = [c for c in args.classes.split(",") if c]
    unknown = [c for c in classes if c not in CLASSES]
    if unknown or not classes:
        ap.error(f"--classes: unknown {unknown}; choose from {','.join(CLASSES)}")
    skipped = {}
    if "disk_full" in classes:
        probe = out / ".tmpfs-probe"
        why = mount_tmpfs(probe, 1 << 20)
        if why is None:
            unmount(probe)
        else:
            skipped["disk_full"] = f"cannot mount a tmpfs (needs root): {why}"
            classes.remove("disk_full")
            print(f"chaos: disk_full skipped: {skipped['disk_full']}", file=sys.stderr)
        probe.rmdir() if probe.exists() else None
    if not classes:
        ap.error("no fault class left to draw from")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    common = ["run.progress=false", f"run.steps={args.steps}", f"run.checkpoint_every={args.checkpoint_every}",
              f"run.seed={args.job_seed}", *args.set]
    rng = random.Random(args.seed)
    plans = [(schedules[i % len(schedules)], draw(rng, classes, args.max_faults, args.steps)) for i in range(args.runs)]

    refs: dict[str, Path] = {}
    rows = []
    t_all = time.monotonic()
    for i, (schedule, faults) in enumerate(plans):
        overrides = [*common, f"pipeline.schedule={schedule}"]
        if schedule not in refs:
            t = time.monotonic()
            refs[schedule] = reference(out, schedule, overrides, env, args.timeout)
            print(f"chaos: reference {schedule}: {refs[schedule]} ({time.monotonic() - t:.0f} s)", file=sys.stderr)
        work = out / f"seed{args.seed}-run{i}"
        shutil.rmtree(work, ignore_errors=True)
        r = run_once(work, overrides, faults, env, args.resumes, args.timeout, disk=any(f == "disk_full" for f, _ in faults))
        c = check_run(r["run_dir"], refs[schedule], args.steps) if r["run_dir"] is not None else {
            "completed": False, "final_checkpoint": False, "lost_or_doubled": args.steps, "diverged": 0,
            "steps_retrained": 0, "rewinds": 0, "max_loss_diff": None, "problems": ["no run directory"]}
        ok = c["completed"] and c["final_checkpoint"] and not c["lost_or_doubled"] and not c["diverged"] and r["outcome"] is None
        outcome = "ok" if ok else (r["outcome"] or "; ".join(c["problems"][:2]) or "failed")
        row = {"run": i, "schedule": schedule, "planned": [f"{n}@{a}" for n, a in faults], "faults": r["injected"],
               "not_injected": r["not_injected"], "resumes": r["resumes"], "exit_codes": r["exit_codes"],
               "outcome": outcome, "wall_s": round(r["wall_s"], 1), "run_dir": str(r["run_dir"]), "notes": r["notes"], **c}
        rows.append(row)
        print(f"chaos: run {i} {schedule} {' '.join(r['injected']) or '-'}: {outcome} ({r['wall_s']:.0f} s; "
              f"exits {r['exit_codes']})", file=sys.stderr)
        (work / "result.json").write_text(json.dumps(row, indent=1, default=str))

    print(f"{'run':>3}  {'schedule':<12}  {'faults injected':<44}  {'res':>3}  {'outcome':<32}  {'lost_or_doubled':>15}  "
          f"{'steps_retrained':>15}  {'wall s':>6}")
    for r in rows:
        print(f"{r['run']:>3}  {r['schedule']:<12}  {(' '.join(r['faults']) or '-'):<44}  {r['resumes']:>3}  "
              f"{r['outcome'][:32]:<32}  {r['lost_or_doubled']:>15}  {r['steps_retrained']:>15}  {r['wall_s']:>6.0f}")
    by_class: dict[str, int] = {}
    for r in rows:
        for f in r["faults"]:
            by_class[f.split("@")[0]] = by_class.get(f.split("@")[0], 0) + 1
    summary = {"runs": len(rows), "faults": sum(len(r["faults"]) for r in rows),
               "completed": sum(1 for r in rows if r["completed"]),
               "lost_or_doubled": sum(r["lost_or_doubled"] for r in rows),
               "steps_retrained": sum(r["steps_retrained"] for r in rows),
               "diverged": sum(r["diverged"] for r in rows), "ok": sum(1 for r in rows if r["outcome"] == "ok"),
               "faults_by_class": by_class, "skipped_classes": skipped, "seed": args.seed, "steps": args.steps,
               "schedules": schedules, "resumes": sum(r["resumes"] for r in rows),
               "wall_s": round(time.monotonic() - t_all, 1), "out": str(out)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
