"""``dynaresize run CONFIG [overrides]``: the main job.

Until the GRPO job with dynamic resizing lands (issue 5), this runs the control-plane demo on the same config:
an embedded real redis-server, simulated ranks that register, heartbeat, receive role-switch commands and ack
them, and a dead rank noticed by the coordinator. The README says so.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dynaresize.control import demo

    demo.add_arguments(p)


def main(args: argparse.Namespace) -> int:
    from dynaresize.control import demo

    print("dynaresize run: the GRPO job is not built yet; running the control-plane demo on this config.")
    return demo.main(args)
