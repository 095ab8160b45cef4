"""Config of the RL algorithm's options beyond the loss (section ``algorithm``): DAPO's dynamic sampling and
overlong reward shaping (arXiv 2503.14476, sections 3.2 and 3.4; see ``dynaresize.rl.dapo``) and truncated
importance sampling on the rollout/trainer ratio (``dynaresize.rl.mismatch``). The loss's own options (clip, KL,
normalisation) are in ``train``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dynaresize.config.base import Section


class DynamicSamplingConfig(Section):
    enabled: bool = Field(
        False, description="Drop prompt groups whose rewards are all equal and generate more prompts until the batch "
        "holds rollout.prompts_per_step groups; kept groups are chosen in prompt order (DAPO dynamic sampling)"
    )
    max_rounds: int = Field(
        4, ge=1, description="Extra generation rounds per step at most, after the first (bounds the extra generation)"
    )
    round_prompts: int | None = Field(
        None, ge=1, description="Prompts each extra round adds (null: rollout.prompts_per_step); at most "
        "max_rounds x round_prompts extra prompts per step"
    )
    on_unfilled: Literal["pad", "fail"] = Field(
        "pad", description="After max_rounds still too few informative groups: pad (train on the earliest dropped "
        "groups too, advantage 0, batch size kept; an event says so) or fail (the job stops with that message)"
    )


class OverlongConfig(Section):
    enabled: bool = Field(
        False, description="DAPO soft overlong punishment: responses longer than rollout.max_tokens - buffer tokens "
        "lose reward linearly, up to factor at rollout.max_tokens"
    )
    buffer: int = Field(
        4, ge=1, description="L_cache: length of the punishment interval before rollout.max_tokens (tokens, EOS included)"
    )
    factor: float = Field(1.0, ge=0, description="Penalty at the full length (the reward added is -factor x the fraction of the interval used)")


class TisConfig(Section):
    enabled: bool = Field(
        False, description="Truncated importance sampling (Yao et al. 2025; verl rollout_is, slime --use-tis): weight "
        "each token's policy-gradient loss by min(pi_train / pi_rollout, cap), detached, with the PPO ratio taken "
        "against the trainer's own logprobs (decoupled PPO); corrects the rollout engine's mismatch and the samples' "
        "staleness. Off: the loss is unchanged (the ratio against the rollout's logprobs)"
    )
    cap: float = Field(
        2.0, ge=1, allow_inf_nan=False, description="C: the largest importance weight (the blog and verl's examples "
        "use 2.0 at token level); at least 1, since a cap below 1 would shrink the tokens on which both sides agree"
    )
    level: Literal["token", "sequence"] = Field(
        "token", description="token: one weight per token (TIS); sequence: one per response, "
        "min(prod_t pi_train / pi_rollout, cap) (verl's rollout_is_level: sequence)"
    )


class AlgorithmConfig(Section):
    advantage: Literal["grpo", "grpo_no_std", "rloo"] = Field(
        "grpo", description="Advantage estimator over each prompt's group of rewards: grpo ((r - mean) / (std + 1e-6), "
        "verl adv_estimator=grpo), grpo_no_std (r - mean: Dr. GRPO, verl norm_adv_by_std_in_grpo=false) or rloo "
        "(r_i - the mean of the group's other rewards, verl adv_estimator=rloo); dynaresize.rl.grpo.advantages"
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig, description="DAPO dynamic sampling (group filtering with over-sampling)"
    )
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description="DAPO overlong reward shaping")
    tis: TisConfig = Field(
        default_factory=TisConfig, description="Truncated importance sampling on the rollout/trainer logprob ratio "
        "(the training-inference mismatch correction; off by default)"
    )
