"""DynaResize: RL post-training that moves GPUs between the rollout and training roles while the job runs.

Importing the package is cheap on purpose (no torch, no redis): the CLI, the config and the simulator must start fast.
"""

__version__ = "0.1.0"
