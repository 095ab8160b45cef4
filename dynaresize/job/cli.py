"""``dynaresize run CONFIG [overrides] | --resume RUN_DIR``: GRPO with dynamic resizing on this machine.

Starts a private redis-server, ``cluster.gpus`` worker processes (one per device slot: a CPU slot here, a GPU on a
cluster) and the coordinator; shows a progress bar (step, reward, the role of each rank, switches); leaves a run
directory with the resolved config, the event log, checkpoints and ``summary.json``.

    dynaresize run configs/quickstart.yaml                 # dynamic resizing, 4 CPU ranks
    dynaresize run configs/quickstart-static.yaml          # the same job with the split held static
    dynaresize run --resume runs/quickstart-20261130-...   # continue a stopped run (same step counter)
    dynaresize run --resume runs/quickstart-... run.steps=40  # extend a completed run to 40 steps
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__
    p.add_argument("config", nargs="?", help="experiment YAML (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.steps=10 cluster.gpus=4")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR: take over its ranks if they are still alive (coordinator killed), else restart them from its last good checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args: argparse.Namespace, launcher_factory=None) -> int:
    """``launcher_factory``: the coordinator's (default: local rank processes of ``dynaresize.worker.main``)."""
    from dynaresize.config.loader import load_config
    from dynaresize.rundir import RunDirError, create_run_dir, require_run_dir

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.resume and args.config and "=" in args.config:  # `--resume DIR k=v ...`: argparse took k=v as CONFIG
        args.overrides, args.config = [args.config, *args.overrides], None
    if args.resume:
        if args.config:
            print("dynaresize run: give either CONFIG or --resume RUN_DIR (the run's own config.yaml is used)", file=sys.stderr)
            return 2
        try:
            run_dir = require_run_dir(args.resume)  # never a folder the project did not create
        except RunDirError as e:
            print(f"dynaresize run: --resume: {e}", file=sys.stderr)
            return 2
        cfg = load_config(run_dir / "config.yaml", args.overrides)
        from dynaresize.job.ranks import leftover_ranks
        from dynaresize.job.resume_plan import ResumeRefused, plan_resume

        try:  # before anything is written into the run: a refused resume leaves it as it was
            plan = plan_resume(run_dir, load_config(run_dir / "config.yaml"), cfg, leftover_ranks(run_dir))
        except ResumeRefused as e:
            print(f"dynaresize run: --resume {run_dir}: refused: {e}", file=sys.stderr)
            return 2
        if plan.extends:
            print(f"extending {run_dir}: from its final checkpoint (step {plan.step}) to step {plan.steps}")
    else:
        if not args.config:
            print("dynaresize run: CONFIG is required (e.g. configs/quickstart.yaml), or --resume RUN_DIR", file=sys.stderr)
            return 2
        cfg = load_config(args.config, args.overrides)
        run_dir = None
    from dynaresize.metrics import MissingLoggerError, check_available

    try:  # a logger asked for whose package is missing: refused before anything is created
        check_available(cfg.metrics)
    except MissingLoggerError as e:
        print(f"dynaresize run: {e}", file=sys.stderr)
        return 2
    from dynaresize.config.memory import check_config

    # memory: a split no GPU can hold, a micro-batch below one sequence, a model without the fields the memory model
    # needs: refused here, before any rank starts (ConfigError: one line, exit 2; docs/memory.md)
    check_config(cfg)
    if run_dir is None:
        run_dir = create_run_dir(cfg.run.output_dir, cfg.run.name)
    # torch and DeepSpeed are imported only once the config is valid: a bad config is refused within a second
    from dynaresize.control.commands import EpochTaken, FencedError
    from dynaresize.job.coordinator import Coordinator
    from dynaresize.job.errors import JobError
    from dynaresize.job.state import StateError

    if args.quiet or not cfg.run.progress:
        quiet_progress()  # no library's progress bar either (transformers' "Writing model shards" on a model build)
    bar = _progress(cfg.run.steps, enabled=cfg.run.progress and not args.quiet)
    try:
        coord = Coordinator(cfg, run_dir, resume=bool(args.resume), on_step=bar.update if bar else None,
                            launcher_factory=launcher_factory)
    except StateError as e:  # --resume and no intact checkpoint: what is damaged, nothing deleted
        if bar:
            bar.close()
        print(f"dynaresize run: --resume {run_dir}: {e}", file=sys.stderr)
        return 1
    coord.install_signal_handlers()
    print(f"run dir  {run_dir}")
    try:
        summary = coord.run()
    except JobError as e:
        print(f"dynaresize run: {e}", file=sys.stderr)
        print(f"run dir  {run_dir} (resume with: dynaresize run --resume {run_dir})", file=sys.stderr)
        return 1
    except FencedError as e:  # the message says who took the epoch and how (the job's owner record)
        # (no "resume with": the run is not stopped, the other coordinator runs it. A redis-server this process started
        # is not shut down, but it ends with this process -- its parent-death signal: never an orphan server -- and
        # the owner's watchdog starts it again from its append-only file, the ranks riding the gap out)
        print(f"dynaresize run: {e}; that coordinator owns the run now: this one stops without touching its ranks or "
              f"its Redis (nothing to resume)", file=sys.stderr)
        return 3
    except EpochTaken as e:  # a fresh start found the job's epoch taken: nothing was started
        print(f"dynaresize run: {e}", file=sys.stderr)
        return 2
    finally:
        if bar:
            bar.close()
    _print_summary(summary)
    stop = summary.get("operator_stop")
    if summary.get("incomplete"):  # every step trained, but the final checkpoint (the weights) is not on disk
        print(f"dynaresize run: {summary['incomplete']}\nresume with: dynaresize run --resume {run_dir}", file=sys.stderr)
        return 1
    if stop and summary["status"] != "completed":  # the real cause of the early end, and the way on
        print(f"stopped: {stop['text']}\nresume with: dynaresize run --resume {run_dir}", file=sys.stderr)
    return 0 if summary["status"] == "completed" else 130


def quiet_progress() -> None:
    """No progress bars of the libraries a run uses (huggingface_hub's, and transformers' own switch, which it reads
    once at import): set before they are imported, switched off if they already are."""
    import os

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


class _Bar:
    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)

    def update(self, info: dict) -> None:
        self.bar.n = info["step"] + 1
        self.bar.set_postfix_str(
            f"reward {info['reward']:.3f} roles {info['roles']} switches {info['switches']} "
            f"rollout {info['rollout_s']:.1f}s train {info['train_s']:.1f}s"
        )

    def close(self) -> None:
        self.bar.close()


def _progress(total: int, enabled: bool):
    return _Bar(total) if enabled else None


def _print_summary(s: dict) -> None:
    def f(x):
        return "-" if x is None else f"{x:.3f}"

    print(f"\n{s['status']}: {s['steps']} steps, {s['samples']} samples in {s['loop_s']:.1f} s of RL steps "
          f"({s['samples_per_s']:.2f} samples/s; {s['elapsed_s']:.1f} s with start-up), split now {s['final_split']} ({s['policy']}), "
          f"rollout engine {s.get('rollout_engine', 'torch')}")
    print(f"mean reward: first step {f(s['reward_first'])}, last step {f(s['reward_last'])} "
          f"(first 3 {f(s['reward_first3'])}, last 3 {f(s['reward_last3'])})")
    if s.get("val_reward_first") is not None:
        v0, v1 = s["val_versions"]
        print(f"validation: mean reward {f(s['val_reward_first'])} (version {v0}) -> {f(s['val_reward_last'])} (version {v1}), "
              f"pass@{s['val_k']} {f(s['val_pass_at_k_first'])} -> {f(s['val_pass_at_k_last'])}")
    if s["switches"]:
        print(f"switches ({len(s['switches'])}, {s['switch_critical_path_s']:.2f} s on the critical path):")
        for sw in s["switches"]:
            print(f"  step {sw['step']:>3}: {sw['from']} -> {sw['to']}  critical {sw['critical_path_s']:.2f} s, hidden {sw['hidden_s']:.2f} s")
    else:
        print("switches: none")
    if s.get("emulation") is not None:
        from dynaresize.emulation.report import describe

        print(describe(s["emulation"]))
    print(f"summary  {Path(s['run_dir']) / 'summary.json'}")
    keys = ('steps', 'samples_per_s', 'reward_first', 'reward_last', 'switch_critical_path_s', 'elapsed_s',
            'val_reward_first', 'val_reward_last', 'val_pass_at_k_first', 'val_pass_at_k_last')
    print(json.dumps({k: s[k] for k in keys if k in s}))
