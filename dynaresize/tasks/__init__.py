"""RL tasks: prompts, reference answers and verifiable rewards, with a length curriculum.

``load_task(cfg.task)`` builds the task a config names; ``Task`` is the protocol a user task implements.
"""

from dynaresize.tasks.base import DEFAULT_ALPHABET, Curriculum, LengthTailTask, Task, sample_rng
from dynaresize.tasks.registry import BUILTIN_TASKS, load_task

__all__ = ["BUILTIN_TASKS", "DEFAULT_ALPHABET", "Curriculum", "LengthTailTask", "Task", "load_task", "sample_rng"]
