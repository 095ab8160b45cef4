"""What the coordinator (``dynaresize.job``) and the worker ranks (``dynaresize.worker``) share, and nothing else.

- :mod:`~dynaresize.contract.protocol`: the command kinds, each with its payload and result model (``COMMANDS``;
  ``CommandKind`` is derived from it);
- :mod:`~dynaresize.contract.workqueue`: the rollout work queue in Redis, its work items and sample results;
- :mod:`~dynaresize.contract.batch`: the training batch of a step as it crosses Redis;
- :mod:`~dynaresize.contract.dataplane`: the worker's reader of both (``RedisDataPlane``).

It imports neither ``dynaresize.job`` nor ``dynaresize.worker`` (``tests/unit/test_structure.py``).
"""
