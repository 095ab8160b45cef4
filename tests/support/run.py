"""``dynaresize run`` whose ranks start through ``tests.support.dynaresize_worker`` (the test hooks):

    python -m tests.support.run CONFIG [overrides] | --resume RUN_DIR

Same arguments and coordinator as ``dynaresize run``; only the rank entry differs. A run resumed with it restarts
its ranks (a coordinator given a launcher never attaches to live ones); resume with ``dynaresize run`` to take
them over.
"""

from __future__ import annotations

import argparse
import sys

from dynaresize.job import cli
from dynaresize.job.launcher import LocalLauncher


def launcher(run_dir, world: int, job_id: str, device: str) -> LocalLauncher:
    return LocalLauncher(run_dir, world, job_id, device, module="tests.support.dynaresize_worker")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tests.support.run", description=__doc__.split("\n")[0])
    cli.add_arguments(parser)
    sys.exit(cli.main(parser.parse_args(), launcher_factory=launcher))
