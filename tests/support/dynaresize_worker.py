"""A worker rank with the test hooks (``tests.support.hooks.RankHooks``, faults from the environment):

    python -m tests.support.dynaresize_worker --run-dir RUN --rank R --world N --master-port P --job-id J

the arguments and the serve loop of ``dynaresize.worker.main``; started by the launcher of ``tests.support.run``.
The module's name says ``dynaresize``: a coordinator that takes a run over (``--resume``) counts a live process as
one of the run's ranks only when its command line names dynaresize and the run.
"""

from __future__ import annotations

import argparse
import sys

from dynaresize.worker import main as worker_main
from tests.support.hooks import RankHooks

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tests.support.dynaresize_worker", description=__doc__.split("\n")[0])
    worker_main.add_arguments(parser)
    sys.exit(worker_main.main(parser.parse_args(), hooks=RankHooks.from_env()))
