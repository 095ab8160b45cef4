"""PPO mini-batches and epochs over one RL step's batch (``train.mini_batches``, ``train.epochs``; verl's
``ppo_mini_batch_size`` and ``ppo_epochs``): which samples each optimizer step trains on, in what order. Pure: the
worker holds the samples and runs the steps (``dynaresize.worker.core``).

The batch's groups, in the batch's group order (ascending prompt index: the order ``build_batch`` and
``BatchAssembler.build`` give the whole batch, whichever rank generated a group and whenever it arrived), are cut
into ``M`` equal mini-batches of consecutive groups; the step runs ``E`` passes, each the ``M`` mini-batches in
order: ``M x E`` optimizer steps, each on one mini-batch's loss normalised by that mini-batch's own token (or
sequence) count, as verl normalises each mini-batch. The policy version advances once, after the last one.
Worked example, 6 groups, M = 3, E = 2: steps on groups (0, 1), (2, 3), (4, 5), (0, 1), (2, 3), (4, 5).

Streaming: the first pass's mini-batch ``m`` can step as soon as its groups are all in and mini-batch ``m - 1``
has stepped (``ready``), which needs the batch's group order ahead of time: known when the batch trains every
generated group (prompts ``0 .. B - 1``); with dynamic sampling the order is known only at the batch's end, and
every step runs then. Either way the steps are the same computation, in the same order, as the barrier run's.

The PPO ratio's "old" logprobs are the rollout engine's (the behaviour policy's, version ``k - 1`` with
staleness 1), in every mini-batch and epoch, and in every schedule: verl recomputes them with the trainer before the
first update, which would hold every step until the whole batch is in (no streaming); the behaviour logprobs are
what the loss uses with ``mini_batches = 1`` already.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def bounds(groups: int, mini_batches: int) -> list[tuple[int, int]]:
    """Positions ``[lo, hi)`` in the batch's group order of each mini-batch (equal sizes: ``mini_batches`` divides
    ``groups``)."""
    if mini_batches < 1 or groups % mini_batches:
        raise ValueError(f"{groups} groups do not split into {mini_batches} equal mini-batches")
    size = groups // mini_batches
    return [(m * size, (m + 1) * size) for m in range(mini_batches)]


def prompt_of(key: str) -> int:
    """The prompt (group) index of sample ``key`` (``<step>.<prompt>.<index>``)."""
    parts = key.split(".")
    if len(parts) != 3 or not parts[1].isdigit():
        raise ValueError(f"sample key {key!r} is not <step>.<prompt>.<index>")
    return int(parts[1])


@dataclass
class MiniBatches:
    """One RL step's samples held by a trainer while its mini-batches step: rows by group, and where it is."""

    step: int  # the RL step (batch) held
    mini_batches: int
    epochs: int
    groups: int | None = None  # groups the batch trains when known ahead (prompts 0 .. groups - 1); None: at its end
    rows: dict[int, list[int]] = field(default_factory=dict)  # prompt -> indices into ``samples``
    samples: list = field(default_factory=list)  # (key, prompt ids, response ids, logprobs, advantage, version)
    streamed: int = 0  # first-pass mini-batches stepped so far

    @property
    def steps(self) -> int:
        return self.mini_batches * self.epochs

    def add(self, rows: list) -> None:
        """Samples of complete groups (each a tuple whose first element is the sample key)."""
        for row in rows:
            p = prompt_of(row[0])
            self.rows.setdefault(p, []).append(len(self.samples))
            self.samples.append(row)

    def order(self) -> list[int]:
        """The batch's group order (ascending prompt index) of the groups held."""
        return sorted(self.rows)

    def ready(self) -> list[int]:
        """First-pass mini-batches that can step now, in order (streaming; empty while the order is unknown)."""
        if self.groups is None:
            return []
        out = []
        for m, (lo, hi) in enumerate(bounds(self.groups, self.mini_batches)):
            if m < self.streamed:
                continue
            if not all(p in self.rows for p in range(lo, hi)):
                break
            out.append(m)
        return out

    def members(self, m: int) -> list:
        """The samples of mini-batch ``m``, in the batch's order (group by group, each group's own order)."""
        order = list(range(self.groups)) if self.groups is not None else self.order()
        lo, hi = bounds(len(order), self.mini_batches)[m]
        return [self.samples[i] for p in order[lo:hi] for i in self.rows.get(p, [])]

    def remaining(self) -> list[tuple[int, int]]:
        """(epoch, mini-batch) of every step not run yet, in order; the batch must be whole by now."""
        groups = self.groups if self.groups is not None else len(self.rows)
        if self.groups is not None and len(self.rows) != self.groups:
            missing = sorted(set(range(self.groups)) - set(self.rows))[:5]
            raise ValueError(f"the batch's optimizer steps need its {self.groups} groups; missing e.g. {missing}")
        bounds(groups, self.mini_batches)  # (raises when the groups do not split evenly)
        return [(e, m) for e in range(self.epochs) for m in range(self.mini_batches) if e > 0 or m >= self.streamed]
