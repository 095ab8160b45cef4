"""DAPO's reward shaping and group filtering as pure functions (no Redis, no clock, no randomness).

Source: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476, sections
3.2 (dynamic sampling) and 3.4 (overlong reward shaping). Clip-higher (section 3.1) lives in the loss
(``GrpoLoss.clip_eps_low``/``clip_eps_high``, ``dynaresize.rl.grpo``).

Overlong reward shaping (DAPO eq. 13, "soft overlong punishment"), with ``L_max = rollout.max_tokens`` and
``L_cache = algorithm.overlong.buffer``; a response's length ``|y|`` counts its tokens, EOS included::

    penalty(|y|) = 0                                  if |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                 = -1                                 if |y| > L_max
    shaped reward = reward + factor * penalty(|y|)

Worked example: ``L_max = 16``, ``L_cache = 4``, factor 1: lengths 12 -> 0, 13 -> -0.25, 14 -> -0.5, 16 -> -1.

Dynamic sampling (DAPO eq. 11): a group whose rewards are all equal has advantage 0 for every response, so it adds
no policy gradient; such groups are dropped and more prompts are generated until the batch holds
``prompts_per_step`` groups that carry a signal. Which groups are kept is decided in **prompt order** (the first
``need`` informative prompts by prompt index), never in the order results arrived, so a resized run and a static
run with the same seed keep exactly the same groups. Worked example, need 2, rewards per prompt
``[[1,1], [0,1], [0,0], [1,0], [0,1]]``: prompts 1 and 3 are kept, 0 and 2 dropped, 4 is surplus (generated, not
needed, not trained on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment for a response of ``length`` tokens (<= 0; see the module docstring)."""
    if buffer <= 0:
        raise ValueError(f"overlong buffer must be >= 1 token, got {buffer}")
    expected = max_tokens - buffer
    if length <= expected:
        return 0.0
    if length > max_tokens:
        return -float(factor)
    return factor * (expected - length) / buffer


@dataclass(frozen=True)
class OverlongShaping:
    """The overlong punishment of one run: ``max_tokens`` (L_max), ``buffer`` (L_cache), ``factor``."""

    max_tokens: int
    buffer: int
    factor: float = 1.0

    def penalty(self, length: int) -> float:
        return overlong_penalty(length, self.max_tokens, self.buffer, self.factor)

    @classmethod
    def from_config(cls, cfg) -> "OverlongShaping | None":
        """From a whole ``Config``: None unless ``algorithm.overlong.enabled``."""
        ov = cfg.algorithm.overlong
        return cls(cfg.rollout.max_tokens, ov.buffer, ov.factor) if ov.enabled else None


def informative(rewards: Sequence[float], tol: float = 0.0) -> bool:
    """A group carries a policy-gradient signal when its rewards are not all equal (max - min > ``tol``)."""
    return len(rewards) > 1 and (max(rewards) - min(rewards)) > tol


@dataclass(frozen=True)
class GroupSelection:
    """Which prompt groups of one step are trained on, decided in prompt order."""

    kept: tuple[int, ...]  # prompt indices trained on (ascending), at most ``need``
    dropped: tuple[int, ...]  # prompt indices looked at and dropped (all rewards equal), ascending
    surplus: tuple[int, ...]  # informative prompt indices generated beyond ``need`` (not trained on)
    filler: tuple[int, ...]  # dropped groups trained on anyway to keep the batch size (``on_unfilled='pad'``)

    @property
    def full(self) -> bool:
        return not self.filler

    @property
    def trained(self) -> tuple[int, ...]:
        """Prompt indices of the training batch, in prompt order (kept and filler interleaved by index)."""
        return tuple(sorted(self.kept + self.filler))


def select_groups(group_rewards: Sequence[Sequence[float]], need: int, pad: bool = False, tol: float = 0.0) -> GroupSelection:
    """Keep the first ``need`` informative groups by prompt index. ``group_rewards[p]`` are prompt ``p``'s rewards.

    ``pad``: when fewer than ``need`` are informative, fill up with the earliest dropped groups (their advantages
    are 0: they add no policy gradient, only the KL term and the token count of the loss's denominator)."""
    kept: list[int] = []
    dropped: list[int] = []
    surplus: list[int] = []
    for p, rewards in enumerate(group_rewards):
        if informative(rewards, tol):
            (kept if len(kept) < need else surplus).append(p)
        elif len(kept) < need:
            dropped.append(p)
    filler: tuple[int, ...] = ()
    if pad and len(kept) < need:
        filler = tuple(dropped[: need - len(kept)])
    return GroupSelection(tuple(kept), tuple(dropped), tuple(surplus), filler)


def kept_count(group_rewards: Sequence[Sequence[float]], tol: float = 0.0) -> int:
    return sum(1 for r in group_rewards if informative(r, tol))


def next_round_prompts(kept: int, need: int, rounds_done: int, max_rounds: int, round_prompts: int) -> int:
    """How many prompts the next generation round adds (0: stop). ``kept``: informative groups so far, ``rounds_done`` extra rounds run already (the first generation is not counted).

    A round adds ``round_prompts`` prompts (a fixed size, so the plan depends only on the rewards seen, never on
    timing); there are at most ``max_rounds`` extra rounds, i.e. at most ``max_rounds * round_prompts`` prompts
    beyond the first ``need``."""
    if kept >= need or rounds_done >= max_rounds:
        return 0
    return int(round_prompts)
