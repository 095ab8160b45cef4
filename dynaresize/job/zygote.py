"""A pre-imported parent for the local worker ranks: imports torch, transformers and DeepSpeed once, then forks.

Every rank process pays about 10 s of CPU for its third-party imports (torch 4 s, transformers 3.5 s, DeepSpeed
2 s on this machine). Four ranks started side by side on two cores spend about 20 s of wall time on them before
the first one registers; eight or sixteen (an emulated cluster) spend a minute or more. The local launcher
(:class:`dynaresize.job.launcher.LocalLauncher`) therefore starts this one process, which does those imports once
(gc paused, then frozen), and forks one child per rank. A child leads its own session (``os.setsid``: the launcher
stops a rank with ``killpg``, as before), writes to its own ``logs/rank<r>.log``, and runs the worker module as
``__main__`` with the rank's command line, exactly what ``python -m <module> ...`` would run. Its pages are shared
copy-on-write with this parent, so a rank also starts with less private memory.

Fork safety: the parent runs no torch operator and starts no thread (one native thread at the fork, checked at
start-up; more and it refuses to fork and says so), so a child starts like a fresh interpreter that has imported
those modules. Ranks started by ``srun`` (Slurm) do not use this: each is its own process there.

Protocol (JSON lines, nothing pickled), launcher -> stdin: ``{"rank": r, "argv": [...], "log": path}``;
stdout -> launcher: ``{"ready": n_threads}`` after the imports, ``{"spawned": r, "pid": p}``,
``{"exited": r, "pid": p, "code": c}`` (negative: killed by that signal), ``{"error": text}``. At end of input it
exits once every child it forked has exited and been reaped (so none is left a zombie). It ignores SIGINT and
SIGTERM (a stop is the coordinator's to carry out); a rank's process name is ``dynaresize-r<rank>``, its command
line the zygote's (which names the run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import select
import signal
import sys

DEFAULT_MODULE = "dynaresize.worker.main"


def _send(msg: dict) -> None:
    os.write(1, (json.dumps(msg) + "\n").encode())  # raw fd, no buffered object a child could inherit half-full


def preload(module: str, run_dir: str | None = None) -> None:
    """The imports every rank makes (:func:`dynaresize.worker.main.preload_rank_imports`: vLLM's too when the run's
    ``rollout.engine`` is vllm, ~14 s of CPU paid once here instead of once per rank) and the worker module."""
    import importlib
    from pathlib import Path

    from dynaresize.worker.main import preload_rank_imports

    engine = "torch"
    if run_dir is not None and (Path(run_dir) / "config.yaml").exists():
        from dynaresize.config.loader import load_config

        engine = load_config(Path(run_dir) / "config.yaml").rollout.engine
    preload_rank_imports(engine)
    importlib.import_module(module)


def set_name(name: str) -> None:
    """The process name ``ps``, ``top`` and ``pgrep`` show (Linux ``comm``, 15 characters): every rank shares the
    zygote's command line, so the name tells them apart (``dynaresize-r3``)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _child(module: str, rank: int, argv: list[str], log_path: str) -> None:
    """In the forked child: a new session, the rank's log as stdout/stderr, then the module as ``__main__``."""
    import runpy
    import traceback

    code = 1
    try:
        os.setsid()
        set_name(f"dynaresize-r{rank}")
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        sys.argv = [module, *argv]
        sys.modules.pop(module, None)  # its imports stay; the module itself runs afresh as __main__, as with -m
        gc.enable()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a rank's crash: its traceback goes to its log, its exit status says so
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(module: str, run_dir: str | None = None) -> int:
    import time

    t0 = time.monotonic()
    gc.disable()
    try:
        preload(module, run_dir)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which names it for every rank
        _send({"error": f"the worker imports failed: {type(e).__name__}: {e}"})
        return 1
    gc.collect()
    gc.freeze()
    threads = _native_threads()
    print(f"zygote: {module} and the rank imports done in {time.monotonic() - t0:.1f} s; {threads} thread(s)",
          file=sys.stderr, flush=True)
    _send({"ready": threads})
    children: dict[int, int] = {}  # pid -> rank
    buf, eof = b"", False
    while not eof or children:
        if not eof:
            readable, _, _ = select.select([0], [], [], 0.2)
            if readable:
                chunk = os.read(0, 65536)
                eof = not chunk
                buf += chunk
        else:
            select.select([], [], [], 0.2)
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                req = json.loads(line)
                rank, argv, log_path = int(req["rank"]), [str(a) for a in req["argv"]], str(req["log"])
            except (ValueError, KeyError, TypeError) as e:
                _send({"error": f"bad spawn request {line[:200]!r}: {e}"})
                continue
            if _native_threads() > 1:
                _send({"error": f"{_native_threads()} threads in the zygote: refusing to fork rank {rank}"})
                continue
            pid = os.fork()
            if pid == 0:
                _child(module, rank, argv, log_path)
            children[pid] = rank
            _send({"spawned": rank, "pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            rank = children.pop(pid, None)
            if rank is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                _send({"exited": rank, "pid": pid, "code": code})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynaresize.job.zygote", description=__doc__.split("\n")[0])
    p.add_argument("--module", default=DEFAULT_MODULE, help="the rank entry module, run as __main__ in each child")
    p.add_argument("--run-dir", required=True, help="the run (named on the command line, which every rank shares)")
    args = p.parse_args(argv)
    # An operator's stop (Ctrl-C, or SIGTERM to every process of the job) is the coordinator's to carry out; this
    # process only forks and reaps, and leaves once its input is closed and its children are gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    set_name("dynaresize-zyg")
    return serve(args.module, args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
