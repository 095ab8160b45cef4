"""The emulated accelerator (``cluster.device: emulated``): real engines on the CPU, GPU-like wall time.

An EMULATION, named so everywhere: the worker ranks run the real tiny model on the CPU (tokens, rewards and RL
updates are real), and each decode iteration, prefill, training micro-batch, optimizer step, weight transfer and
switch op then lasts the wall time that a GPU profile predicts (the simulator's physics: ``sim.rollout``,
``sim.train``, ``switching.costs``), scaled by ``emulation.time_scale``. See docs/emulation.md.
"""


def torch_device(device: str) -> str:
    """The torch device a rank of ``cluster.device`` computes on: an emulated accelerator is the CPU."""
    return "cpu" if device == "emulated" else device
