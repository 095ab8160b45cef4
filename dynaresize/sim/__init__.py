"""Discrete-event simulator of the one-step-off RL pipeline with dynamic resizing (see docs/simulator.md).

``workload`` draws batches, ``stages`` turns them into stage times, ``engine`` runs the pipeline with a policy
and writes the event log, ``compare`` runs the baselines and the oracle, ``cli`` is ``dynaresize simulate``.
"""
