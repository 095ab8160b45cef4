"""A verl PPO-trainer config (GRPO/DAPO) translated into this project's keys: ``dynaresize config from-verl``.

Pure: a verl config as a mapping in, a :class:`Translation` out (our keys with their values and the verl key each came
from, and every verl key not translated with the reason); no file, no Redis, no model. The table (:data:`TABLE`) is
data: one :class:`Rule` per verl key or key pattern, what it becomes here and how, or why it has no counterpart.
docs/from-verl.md shows the same table (:func:`markdown_table`).

What counts as a key a run sets: every leaf of the verl mapping (a Hydra-composed config, e.g. verl's
``_generated_ppo_trainer.yaml`` layout, plus ``key=value`` overrides as a verl run script gives them) except ``null``
and empty values. ``${a.b}`` and ``${oc.select:a.b,default}`` interpolations are resolved against the same mapping.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import yaml

Flat = Mapping[str, Any]
Convert = Callable[[Any, Flat], dict[str, Any]]
MATH_REWARD = "dynaresize.rewards.math:compute_score"
SECTIONS = ("run", "cluster", "model", "rollout", "train", "algorithm", "task", "reward", "metrics")  # output order


class Untranslated(Exception):
    """Raised by a conversion: this value has no counterpart here; the message says why."""


@dataclass(frozen=True)
class Rule:
    verl: str  # verl's dotted key, or an fnmatch pattern ('*' spans dots) for a whole family
    ours: str  # what it becomes here (for the table); '' when it never becomes anything
    convert: Convert | None  # value, the whole flattened verl config -> our keys; None: never translated
    why: str = ""  # the reason it is not translated (convert None), or a note on the conversion


@dataclass
class Translation:
    keys: dict[str, Any] = field(default_factory=dict)  # our dotted key -> value
    source: dict[str, str] = field(default_factory=dict)  # our dotted key -> the verl key it came from
    untranslated: list[tuple[str, Any, str]] = field(default_factory=list)  # (verl key, value, why)

    def nested(self) -> dict[str, Any]:
        """Our keys as sections, in the order of ``dynaresize config fields``."""
        out: dict[str, Any] = {}
        rank = {name: i for i, name in enumerate(SECTIONS)}
        for key, value in sorted(self.keys.items(), key=lambda kv: rank.get(kv[0].split(".")[0], len(rank))):
            *parents, leaf = key.split(".")
            d = out
            for p in parents:
                d = d.setdefault(p, {})
            d[leaf] = value
        return out


# -- conversions --------------------------------------------------------------------------------------------------


def same(ours: str) -> Convert:
    return lambda v, c: {ours: v}


def handled(by: str) -> Convert:
    """A key read by another key's conversion (``by``): nothing of its own."""
    return lambda v, c: {}


def only(allowed: Any, why: str) -> Convert:
    """A key whose value here is fixed: ``allowed`` (a value or a tuple of them) passes silently, others not."""
    ok = allowed if isinstance(allowed, tuple) else (allowed,)

    def conv(v, c):
        if v in ok:
            return {}
        raise Untranslated(why)
    return conv


def fixed(verl: str, allowed: Any, why: str) -> Rule:
    """A rule for a key whose value is fixed here (see :func:`only`)."""
    shown = " or ".join(map(repr, allowed)) if isinstance(allowed, tuple) else repr(allowed)
    return Rule(verl, "", only(allowed, why), f"only {shown}: {why}")


def choose(ours: str, table: dict[Any, Any], why: str) -> Convert:
    def conv(v, c):
        if v in table:
            return {ours: table[v]}
        raise Untranslated(f"{why} (translated: {', '.join(map(str, table))})")
    return conv


def _files(ours: str) -> Convert:
    def conv(v, c):
        files = [v] if isinstance(v, str) else list(v)
        return {ours: files, "task.name": "dataset"}
    return conv


def _mini_batches(v, c):
    batch = c.get("data.train_batch_size")
    if not isinstance(batch, int) or not isinstance(v, int) or v <= 0:
        raise Untranslated("needs data.train_batch_size (mini-batches = train_batch_size / ppo_mini_batch_size)")
    if batch % v:
        raise Untranslated(f"data.train_batch_size={batch} is not a multiple of it: train.mini_batches must divide the batch")
    return {"train.mini_batches": batch // v}


def _token_budget(v, c):
    if c.get("actor_rollout_ref.actor.use_dynamic_bsz") is True:
        return {"train.micro_batch_tokens": v}
    raise Untranslated("verl uses it only with actor.use_dynamic_bsz=true (micro-batches by tokens)")


def _kl(v, c):
    if c.get("actor_rollout_ref.actor.use_kl_loss") is True:
        return {"train.kl_coef": c.get("actor_rollout_ref.actor.kl_loss_coef", 0.001)}
    return {"train.kl_coef": 0.0}


def _advantage(v, c):
    if v == "grpo":
        return {"algorithm.advantage": "grpo" if c.get("algorithm.norm_adv_by_std_in_grpo", True) else "grpo_no_std"}
    if v == "rloo":
        return {"algorithm.advantage": "rloo"}
    raise Untranslated("only group-relative estimators: grpo (norm_adv_by_std_in_grpo=false: grpo_no_std, Dr. GRPO) "
                       "and rloo; no critic, no GAE, REINFORCE++ or ReMax")


def _warmup_steps(v, c):
    if isinstance(v, int) and v >= 0:
        return {"train.lr_warmup_steps": v}
    ratio = c.get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio") or 0.0
    if not ratio:
        return {}
    total = c.get("trainer.total_training_steps")
    if not isinstance(total, int):
        raise Untranslated(f"lr_warmup_steps_ratio={ratio} needs trainer.total_training_steps to become steps; "
                           "set train.lr_warmup_steps")
    return {"train.lr_warmup_steps": int(ratio * total)}


def _run_length(v, c):
    if isinstance(c.get("trainer.total_training_steps"), int):
        raise Untranslated("trainer.total_training_steps is set and decides the run's length (run.steps)")
    return {"run.epochs": v}


def _val_temperature(v, c):
    if c.get("actor_rollout_ref.rollout.val_kwargs.do_sample") is False:
        return {"task.dataset.val_temperature": 0.0}
    return {"task.dataset.val_temperature": v}


def _val_do_sample(v, c):
    if v is False and "actor_rollout_ref.rollout.val_kwargs.temperature" not in c:
        return {"task.dataset.val_temperature": 0.0}
    return {}


def _gpus(v, c):
    nodes = c.get("trainer.nnodes", 1) or 1
    return {"cluster.gpus": int(nodes) * int(v), "cluster.gpus_per_node": int(v)}


def _loggers(v, c):
    names = [v] if isinstance(v, str) else list(v)
    unknown = [n for n in names if n not in ("console", "wandb", "tensorboard")]
    if unknown:
        raise Untranslated(f"loggers here: console, wandb (offline), tensorboard; not {', '.join(map(str, unknown))}")
    out: dict[str, Any] = {}
    if "wandb" in names:
        out["metrics.wandb.enabled"] = True
    if "tensorboard" in names:
        out["metrics.tensorboard"] = True
    return out


def _every(ours: str) -> Convert:
    return lambda v, c: {ours: max(int(v), 0)}


def _reward_path(prefix: str) -> Convert:
    def conv(v, c):
        return {"reward.function": f"{v}:{c.get(prefix + '.name') or 'compute_score'}"}
    return conv


def _max_rounds(v, c):
    if int(v) <= 0:
        raise Untranslated("0 means unlimited generation rounds in verl; here they are bounded: set "
                           "algorithm.dynamic_sampling.max_rounds")
    return {"algorithm.dynamic_sampling.max_rounds": int(v)}


MACHINERY = "verl's machinery (Ray, FSDP/Megatron, Hydra, profiling, workers): nothing to set here"
NO_CRITIC = "GRPO/DAPO train no critic (the advantage is group-relative)"
REF = "the reference policy is the initial weights, kept when train.kl_coef > 0"

TABLE: tuple[Rule, ...] = (
    # data
    Rule("data.train_files", "task.dataset.train_files (+ task.name: dataset)", _files("task.dataset.train_files")),
    Rule("data.val_files", "task.dataset.val_files", _files("task.dataset.val_files")),
    Rule("data.train_batch_size", "rollout.prompts_per_step", same("rollout.prompts_per_step")),
    Rule("data.max_prompt_length", "rollout.max_prompt_tokens", same("rollout.max_prompt_tokens")),
    Rule("data.max_response_length", "rollout.max_tokens", same("rollout.max_tokens")),
    Rule("data.filter_overlong_prompts", "rollout.on_overlong", choose("rollout.on_overlong", {True: "filter", False: "fail"}, ""),
         "false: an overlong prompt refuses the run at load (verl's truncation=error fails on it too)"),
    fixed("data.truncation", "error", "prompts are never truncated here: overlong ones are filtered or refused "
                                      "(rollout.on_overlong)"),
    Rule("data.shuffle", "task.dataset.shuffle", same("task.dataset.shuffle")),
    Rule("data.seed", "run.seed", same("run.seed")),
    fixed("data.prompt_key", "prompt", "records hold the prompt under 'prompt' (docs/byo.md)"),
    fixed("data.reward_fn_key", "data_source", "the reward gets each record's 'data_source'"),
    Rule("data.val_batch_size", "", None, "validation is generated as versioned work; task.dataset.val_max_prompts bounds it"),
    Rule("data.tokenizer", "", None, "the model directory's own tokenizer is used"),
    Rule("data.apply_chat_template_kwargs.*", "", None, "the chat template is applied without extra arguments"),
    Rule("data.custom_cls.*", "", None, "records are read by the dataset task, or by your own task class (task.name)"),
    Rule("data.*", "", None, "a data-loader setting of verl's (workers, shared memory, multi-modal keys): none here"),
    # model
    Rule("actor_rollout_ref.model.path", "model.path", same("model.path")),
    Rule("actor_rollout_ref.model.enable_gradient_checkpointing", "train.activation_checkpointing",
         same("train.activation_checkpointing")),
    fixed("actor_rollout_ref.model.lora_rank", 0, "no LoRA: full-parameter training only"),
    Rule("actor_rollout_ref.model.custom_chat_template", "", None, "the model directory's chat template is used "
         "(its tokenizer_config.json or chat_template.jinja)"),
    Rule("actor_rollout_ref.model.*", "", None, "a model-loading option of verl's (kernels, padding removal, LoRA, "
         "remote code): none here"),
    # actor
    Rule("actor_rollout_ref.actor.ppo_mini_batch_size", "train.mini_batches = train_batch_size / ppo_mini_batch_size",
         _mini_batches),
    Rule("actor_rollout_ref.actor.ppo_epochs", "train.epochs", same("train.epochs")),
    Rule("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "train.micro_batch_tokens (with use_dynamic_bsz)", _token_budget),
    Rule("actor_rollout_ref.actor.use_dynamic_bsz", "", handled("ppo_max_token_len_per_gpu")),
    Rule("actor_rollout_ref.actor.ppo_micro_batch_size*", "", None, "micro-batches are sized in tokens here "
         "(train.micro_batch_tokens)"),
    Rule("actor_rollout_ref.actor.clip_ratio", "train.clip_eps", same("train.clip_eps")),
    Rule("actor_rollout_ref.actor.clip_ratio_low", "train.clip_eps_low", same("train.clip_eps_low")),
    Rule("actor_rollout_ref.actor.clip_ratio_high", "train.clip_eps_high", same("train.clip_eps_high")),
    Rule("actor_rollout_ref.actor.clip_ratio_c", "", None, "no dual-clip PPO"),
    Rule("actor_rollout_ref.actor.loss_agg_mode", "train.loss_norm",
         choose("train.loss_norm", {"token-mean": "token", "seq-mean-token-mean": "sequence"},
                "the loss is a token mean or a per-sequence mean")),
    Rule("actor_rollout_ref.actor.entropy_coeff", "train.entropy_coef", same("train.entropy_coef")),
    Rule("actor_rollout_ref.actor.use_kl_loss", "train.kl_coef (kl_loss_coef, or 0)", _kl),
    Rule("actor_rollout_ref.actor.kl_loss_coef", "", handled("use_kl_loss")),
    fixed("actor_rollout_ref.actor.kl_loss_type", ("low_var_kl", "k3"), "the KL penalty is the k3 estimator "
                                                           "(verl's low_var_kl)"),
    Rule("actor_rollout_ref.actor.grad_clip", "train.grad_clip", same("train.grad_clip")),
    Rule("actor_rollout_ref.actor.optim.lr", "train.lr", same("train.lr")),
    Rule("actor_rollout_ref.actor.optim.weight_decay", "train.weight_decay", same("train.weight_decay")),
    Rule("actor_rollout_ref.actor.optim.lr_warmup_steps", "train.lr_warmup_steps", _warmup_steps),
    Rule("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "", handled("lr_warmup_steps")),
    Rule("actor_rollout_ref.actor.optim.warmup_style", "train.lr_schedule",
         choose("train.lr_schedule", {"constant": "constant", "cosine": "cosine"}, "schedules here")),
    Rule("actor_rollout_ref.actor.optim.lr_scheduler_type", "train.lr_schedule",
         choose("train.lr_schedule", {"constant": "constant", "cosine": "cosine"}, "schedules here")),
    Rule("actor_rollout_ref.actor.optim.min_lr_ratio", "train.min_lr_ratio", same("train.min_lr_ratio")),
    fixed("actor_rollout_ref.actor.optim.num_cycles", 0.5, "the cosine schedule is one half cycle"),
    fixed("actor_rollout_ref.actor.optim.total_training_steps", -1, "the schedule spans run.steps"),
    fixed("actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla", "the loss is PPO's clipped objective "
                                                                    "(with DAPO's clip-higher)"),
    fixed("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1, "no sequence parallelism"),
    Rule("actor_rollout_ref.actor.strategy", "", None, "training runs on DeepSpeed ZeRO (train.zero_stage)"),
    Rule("actor_rollout_ref.actor.shuffle", "", None, "mini-batches are taken in sample order (the same on every split)"),
    Rule("actor_rollout_ref.actor.*", "", None, MACHINERY),
    Rule("actor_rollout_ref.ref.*", "", None, REF),
    # rollout
    Rule("actor_rollout_ref.rollout.name", "rollout.engine", choose("rollout.engine", {"vllm": "vllm", "hf": "torch"},
                                                                    "rollout engines here")),
    Rule("actor_rollout_ref.rollout.n", "rollout.group_size", same("rollout.group_size")),
    Rule("actor_rollout_ref.rollout.temperature", "rollout.temperature", same("rollout.temperature")),
    Rule("actor_rollout_ref.rollout.top_p", "rollout.top_p", same("rollout.top_p")),
    Rule("actor_rollout_ref.rollout.top_k", "rollout.top_k", same("rollout.top_k")),
    Rule("actor_rollout_ref.rollout.prompt_length", "rollout.max_prompt_tokens", same("rollout.max_prompt_tokens")),
    Rule("actor_rollout_ref.rollout.response_length", "rollout.max_tokens", same("rollout.max_tokens")),
    Rule("actor_rollout_ref.rollout.dtype", "model.dtype", choose("model.dtype", {"bfloat16": "bfloat16", "bf16": "bfloat16",
                                                                                 "float32": "float32", "fp32": "float32"},
                                                                  "dtypes here")),
    Rule("actor_rollout_ref.rollout.gpu_memory_utilization", "rollout.vllm.gpu_memory_utilization",
         same("rollout.vllm.gpu_memory_utilization")),
    Rule("actor_rollout_ref.rollout.enforce_eager", "rollout.vllm.enforce_eager", same("rollout.vllm.enforce_eager")),
    Rule("actor_rollout_ref.rollout.max_model_len", "rollout.vllm.max_model_len", same("rollout.vllm.max_model_len")),
    Rule("actor_rollout_ref.rollout.max_num_seqs", "rollout.max_running", same("rollout.max_running")),
    Rule("actor_rollout_ref.rollout.update_weights_bucket_megabytes", "rollout.sync_bucket_mb", same("rollout.sync_bucket_mb")),
    fixed("actor_rollout_ref.rollout.tensor_model_parallel_size", 1, "one GPU per rollout rank (no tensor parallelism)"),
    Rule("actor_rollout_ref.rollout.val_kwargs.temperature", "task.dataset.val_temperature (do_sample=false: 0, greedy)",
         _val_temperature),
    Rule("actor_rollout_ref.rollout.val_kwargs.do_sample", "", _val_do_sample),
    Rule("actor_rollout_ref.rollout.val_kwargs.top_p", "task.dataset.val_top_p", same("task.dataset.val_top_p")),
    Rule("actor_rollout_ref.rollout.val_kwargs.n", "task.dataset.val_samples", same("task.dataset.val_samples")),
    fixed("actor_rollout_ref.rollout.val_kwargs.top_k", -1, "validation samples with rollout.top_k"),
    fixed("actor_rollout_ref.rollout.do_sample", True, "training responses are sampled (rollout.temperature)"),
    fixed("actor_rollout_ref.rollout.multi_turn.enable", False, "single-turn responses only (no tools, no agent loop)"),
    Rule("actor_rollout_ref.rollout.multi_turn.*", "", None, "single-turn responses only (no tools, no agent loop)"),
    Rule("actor_rollout_ref.rollout.free_cache_engine", "", None, "vLLM sleeps when a rank leaves the rollout role "
         "(rollout.vllm.sleep_level)"),
    Rule("actor_rollout_ref.rollout.*", "", None, MACHINERY),
    Rule("actor_rollout_ref.*", "", None, MACHINERY),
    # algorithm
    Rule("algorithm.adv_estimator", "algorithm.advantage (with norm_adv_by_std_in_grpo)", _advantage),
    Rule("algorithm.norm_adv_by_std_in_grpo", "", handled("adv_estimator")),
    fixed("algorithm.use_kl_in_reward", False, "the KL is a loss term here (train.kl_coef), not a reward penalty"),
    Rule("algorithm.filter_groups.enable", "algorithm.dynamic_sampling.enabled", same("algorithm.dynamic_sampling.enabled")),
    Rule("algorithm.filter_groups.max_num_gen_batches", "algorithm.dynamic_sampling.max_rounds", _max_rounds),
    Rule("algorithm.filter_groups.metric", "", None, "groups are kept when their rewards (after shaping) differ"),
    Rule("algorithm.kl_penalty", "", None, "used by verl only with use_kl_in_reward"),
    Rule("algorithm.kl_ctrl.*", "", None, "used by verl only with use_kl_in_reward"),
    Rule("algorithm.gamma", "", None, "GAE's discount: GRPO has no value function"),
    Rule("algorithm.lam", "", None, "GAE's lambda: GRPO has no value function"),
    Rule("algorithm.*", "", None, "an estimator option this project does not have (PF-PPO, rollout correction: see "
         "algorithm.tis)"),
    # reward
    Rule("custom_reward_function.path", "reward.function = path:name", _reward_path("custom_reward_function")),
    Rule("custom_reward_function.name", "", handled("path")),
    Rule("custom_reward_function.reward_kwargs.*", "reward.kwargs", None, "(collected into reward.kwargs)"),
    Rule("reward.custom_reward_function.path", "reward.function = path:name", _reward_path("reward.custom_reward_function")),
    Rule("reward.custom_reward_function.name", "", handled("path")),
    Rule("reward.custom_reward_function.reward_kwargs.*", "reward.kwargs", None, "(collected into reward.kwargs)"),
    Rule("reward_model.reward_kwargs.*", "reward.kwargs", None, "(collected into reward.kwargs)"),
    fixed("reward_model.enable", False, "no model-based reward: a function scores (reward.function)"),
    fixed("reward_model.reward_manager", ("naive", "dapo"), "rewards are scored one response at a time on the "
                                                  "rollout ranks (verl's naive manager)"),
    Rule("reward_model.overlong_buffer.enable", "algorithm.overlong.enabled", same("algorithm.overlong.enabled")),
    Rule("reward_model.overlong_buffer.len", "algorithm.overlong.buffer", same("algorithm.overlong.buffer")),
    Rule("reward_model.overlong_buffer.penalty_factor", "algorithm.overlong.factor", same("algorithm.overlong.factor")),
    Rule("reward_model.*", "", None, "a reward-model setting (no model-based reward here)"),
    Rule("reward.*", "", None, "a reward-manager setting of verl's (rewards are scored on the rollout ranks)"),
    # trainer
    Rule("trainer.total_epochs", "run.epochs", _run_length),
    Rule("trainer.total_training_steps", "run.steps", same("run.steps")),
    Rule("trainer.experiment_name", "run.name", same("run.name")),
    Rule("trainer.project_name", "metrics.wandb.project", same("metrics.wandb.project")),
    Rule("trainer.logger", "metrics.wandb.enabled, metrics.tensorboard", _loggers),
    Rule("trainer.n_gpus_per_node", "cluster.gpus = nnodes x n_gpus_per_node, cluster.gpus_per_node", _gpus),
    Rule("trainer.nnodes", "", handled("n_gpus_per_node")),
    Rule("trainer.device", "cluster.device", choose("cluster.device", {"cuda": "cuda", "cpu": "cpu"}, "devices here")),
    Rule("trainer.save_freq", "run.checkpoint_every (-1: 0)", _every("run.checkpoint_every")),
    Rule("trainer.test_freq", "task.dataset.val_every (-1: 0)", _every("task.dataset.val_every")),
    Rule("trainer.max_actor_ckpt_to_keep", "run.keep_checkpoints", same("run.keep_checkpoints")),
    fixed("trainer.val_before_train", True, "validation runs before the first step whenever val_every > 0"),
    fixed("trainer.val_only", False, "evaluate a model with `dynaresize eval`"),
    Rule("trainer.resume_mode", "", None, "resume with `dynaresize run --resume RUN_DIR`"),
    Rule("trainer.resume_from_path", "", None, "resume with `dynaresize run --resume RUN_DIR`"),
    Rule("trainer.default_local_dir", "", None, "checkpoints live in the run directory under run.output_dir"),
    Rule("trainer.balance_batch", "", None, "trainers take contiguous slices of the batch in sample order"),
    Rule("trainer.*", "", None, MACHINERY),
    Rule("critic.*", "", None, NO_CRITIC),
    Rule("defaults", "", None, "a Hydra defaults list: translate the composed config (python -m verl.trainer.main_ppo "
         "--cfg job)"),
    Rule("*", "", None, MACHINERY),
)

KWARGS_PREFIXES = ("custom_reward_function.reward_kwargs.", "reward.custom_reward_function.reward_kwargs.",
                   "reward_model.reward_kwargs.")


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


_INTERP = re.compile(r"^\$\{(?:oc\.select:)?([A-Za-z0-9_.]+)(?:,(.*))?\}$")


def resolve(flat: dict[str, Any]) -> dict[str, Any]:
    """``${a.b}`` and ``${oc.select:a.b,default}`` values replaced by what they name (a few rounds, for chains)."""
    out = dict(flat)
    for _ in range(4):
        for key, value in out.items():
            m = _INTERP.match(value) if isinstance(value, str) else None
            if m and not m.group(1).startswith("."):
                target, default = m.group(1), m.group(2)
                if target in out and not (isinstance(out[target], str) and out[target].startswith("${")):
                    out[key] = out[target]
                elif target not in out and default is not None:
                    out[key] = yaml.safe_load(default)
    return out


def rule_for(key: str) -> Rule:
    """The first rule of :data:`TABLE` whose key (or pattern) matches ``key``; ``*._target_`` is machinery."""
    if key.endswith("._target_") or key == "_target_":
        return Rule(key, "", None, MACHINERY)
    for rule in TABLE:
        if rule.verl == key or ("*" in rule.verl and fnmatch.fnmatchcase(key, rule.verl)):
            return rule
    raise AssertionError("the table ends with '*'")


def _unset(value: Any) -> bool:
    return value is None or value == "???" or (isinstance(value, (list, dict, str)) and not value)


def translate(verl: Mapping[str, Any]) -> Translation:
    """``verl``: the verl config as a mapping (overrides applied). Our keys, and every key not translated with why."""
    flat = resolve(flatten(verl))
    t = Translation()
    for key, value in flat.items():
        if _unset(value):
            continue
        if isinstance(value, str) and value.startswith("${"):
            t.untranslated.append((key, value, "an interpolation this translator cannot resolve: give the value"))
            continue
        if key.startswith(KWARGS_PREFIXES):
            name = key.split("reward_kwargs.", 1)[1]
            t.keys.setdefault("reward.kwargs", {})[name] = value
            t.source["reward.kwargs"] = key.rsplit(".", 1)[0]
            continue
        rule = rule_for(key)
        if rule.convert is None:
            t.untranslated.append((key, value, rule.why))
            continue
        try:
            out = rule.convert(value, flat)
        except Untranslated as e:
            t.untranslated.append((key, value, str(e)))
            continue
        except (TypeError, ValueError) as e:
            t.untranslated.append((key, value, f"not a value this translator reads ({e})"))
            continue
        for ours, v in out.items():
            if ours in t.keys and t.keys[ours] != v:
                t.untranslated.append((key, value, f"conflicts with {t.source[ours]} (already {ours}={t.keys[ours]!r})"))
                continue
            t.keys[ours] = v
            t.source.setdefault(ours, key)
    if t.keys.get("task.name") == "dataset" and "reward.function" not in t.keys:
        t.keys["reward.function"] = MATH_REWARD  # verl's default_compute_score picks a scorer by data_source
        t.source["reward.function"] = "(verl's default reward: the built-in math reward reads \\boxed{}, '####', 'answer is')"
    return t


def render(t: Translation, origin: str) -> str:
    """The translated config as YAML, each key commented with its verl source; the untranslated keys on top."""
    lines = [f"# Translated from the verl config {origin} by `dynaresize config from-verl` (docs/from-verl.md).",
             "# Check it: dynaresize config check THIS_FILE"]
    if t.untranslated:
        lines.append(f"# Not translated ({len(t.untranslated)} keys):")
        lines += [f"#   {key} = {_flow(value)}: {why}" for key, value, why in t.untranslated]
    lines += _emit(t.nested(), "", t.source, 0)
    return "\n".join(lines) + "\n"


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text[:-4].strip() if text.endswith("\n...") else text.removesuffix("...").strip()


def _emit(d: dict[str, Any], prefix: str, source: dict[str, str], depth: int) -> list[str]:
    lines = []
    for key, value in d.items():
        path = f"{prefix}{key}"
        pad = "  " * depth
        if isinstance(value, dict) and path != "reward.kwargs":
            lines.append(f"{pad}{key}:")
            lines += _emit(value, path + ".", source, depth + 1)
        else:
            lines.append(f"{pad}{key}: {_flow(value)}  # verl: {source.get(path, '')}")
    return lines


def describe(t: Translation) -> list[str]:
    """What the command prints: one line per untranslated key; verl's machinery grouped by section (its first two
    levels), the critic and the reference policy by their own."""
    out, grouped = [], {}
    for key, value, why in t.untranslated:
        if why in (MACHINERY, NO_CRITIC, REF):
            parts = key.split(".")
            depth = {MACHINERY: 2, REF: 2, NO_CRITIC: 1}[why]
            section = ".".join(parts[: min(depth, len(parts) - 1)]) or "the top level"
            grouped.setdefault((section, why), []).append(key)
        else:
            out.append(f"not translated: {key} = {_flow(value)}: {why}")
    for (section, why), keys in grouped.items():
        names = ", ".join(k.removeprefix(section + ".") for k in keys[:4]) + (", ..." if len(keys) > 4 else "")
        out.append(f"not translated: {len(keys)} key(s) under {section} ({names}): {why}")
    return out


def markdown_table() -> str:
    """docs/from-verl.md's table, from :data:`TABLE`."""
    rows = ["| verl key | here | note |", "|---|---|---|"]
    for r in TABLE:
        if r.convert is not None and r.convert.__qualname__.startswith("handled"):
            continue
        ours = f"`{r.ours}`" if r.ours else "—"
        note = r.why
        rows.append(f"| `{r.verl}` | {ours} | {note.replace('|', '/')} |")
    return "\n".join(rows)
