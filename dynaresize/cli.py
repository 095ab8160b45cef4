"""The ``dynaresize`` command: a thin dispatcher. Each subcommand lives in its own module, imported only when used,
so ``dynaresize config`` or ``dynaresize simulate`` never pay for torch or DeepSpeed.

A subcommand module provides ``add_arguments(parser)`` and ``main(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("dynaresize.job.cli", "run the main job (GRPO with dynamic resizing) on this machine"),
    "config": ("dynaresize.config.cli", "show, check and document experiment configs"),
    "demo": ("dynaresize.control.demo", "control-plane demo: embedded Redis, simulated ranks, commands and acks"),
    "simulate": ("dynaresize.sim.cli", "discrete-event simulation of static and dynamic splits at any scale"),
    "analyze": ("dynaresize.analysis.cli", "post-hoc analysis of run directories (tables, timeline, Perfetto trace)"),
    "calibrate": ("dynaresize.analysis.calibrate", "fit the simulator's cost model to a real run"),
    "export": ("dynaresize.models.export", "a run's checkpoint as a Hugging Face model directory (transformers, vLLM)"),
    "eval": ("dynaresize.evaluate", "mean reward and pass@k of a model or run over a dataset's prompts (torch or vLLM)"),
    "submit": ("dynaresize.slurm.cli", "submit the job to Slurm as one heterogeneous allocation"),
    "worker": ("dynaresize.worker.main", "(internal) one worker rank; started by the job, not by users"),
}


def _load(name: str):
    module, _ = COMMANDS[name]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None
        raise


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynaresize", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # only the chosen subcommand's module is imported
            mod = _load(name)
            if mod is not None:
                mod.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    mod = _load(args.command)
    if mod is None:
        print(f"dynaresize {args.command}: not available in this build", file=sys.stderr)
        return 2
    from dynaresize.config.loader import ConfigError

    try:
        return int(mod.main(args) or 0)
    except ConfigError as e:
        print(f"dynaresize {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dynaresize {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
