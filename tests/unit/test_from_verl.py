"""``dynaresize config from-verl``: a verl GRPO config (tests/fixtures/verl_style/grpo_gsm8k.yaml, verl's schema)
translated by the table in dynaresize/config/from_verl.py; every key not translated named with the reason, printed
and in the output's header; the table in docs/from-verl.md is the code's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dynaresize.cli import main as cli
from dynaresize.config.from_verl import MACHINERY, TABLE, flatten, markdown_table, translate
from dynaresize.config.loader import load_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "verl_style" / "grpo_gsm8k.yaml"


def verl() -> dict:
    return yaml.safe_load(FIXTURE.read_text())


def test_a_verl_grpo_config_translates_key_by_key():
    t = translate(verl())
    assert t.keys == {
        "task.name": "dataset",
        "task.dataset.train_files": ["~/data/gsm8k/train.parquet"], "task.dataset.val_files": ["~/data/gsm8k/test.parquet"],
        "rollout.prompts_per_step": 64, "rollout.max_prompt_tokens": 512, "rollout.max_tokens": 1024,
        "rollout.on_overlong": "filter", "task.dataset.shuffle": True,
        "model.path": "~/models/Qwen2.5-0.5B-Instruct", "train.activation_checkpointing": True,
        "train.mini_batches": 4,  # 64 prompts / 16 per mini-batch
        "train.micro_batch_tokens": 16384,  # use_dynamic_bsz: true
        "train.clip_eps": 0.2, "train.clip_eps_low": 0.2, "train.clip_eps_high": 0.28, "train.loss_norm": "token",
        "train.entropy_coef": 0.001, "train.kl_coef": 0.001, "train.epochs": 2, "train.grad_clip": 1.0,
        "train.lr": 1e-6, "train.lr_warmup_steps": 10, "train.weight_decay": 0.01, "train.lr_schedule": "cosine",
        "train.min_lr_ratio": 0.1,
        "rollout.engine": "vllm", "rollout.temperature": 1.0, "rollout.top_p": 1.0, "rollout.top_k": -1,
        "rollout.vllm.gpu_memory_utilization": 0.6, "rollout.group_size": 5,
        "task.dataset.val_temperature": 0.0, "task.dataset.val_top_p": 1.0, "task.dataset.val_samples": 1,
        "reward.function": "rewards/gsm8k.py:compute_score", "reward.kwargs": {"method": "flexible", "format_score": 0.1},
        "algorithm.advantage": "grpo_no_std",  # norm_adv_by_std_in_grpo: false (Dr. GRPO)
        "run.epochs": 15, "metrics.wandb.project": "verl_grpo_gsm8k", "run.name": "qwen2.5-0.5b-grpo",
        "metrics.wandb.enabled": True, "cluster.gpus": 8, "cluster.gpus_per_node": 8, "run.checkpoint_every": 20,
        "task.dataset.val_every": 5,
    }
    why = {key: reason for key, _, reason in t.untranslated}
    assert why["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "one GPU per rollout rank (no tensor parallelism)"
    assert why["actor_rollout_ref.actor.strategy"] == "training runs on DeepSpeed ZeRO (train.zero_stage)"
    assert why["actor_rollout_ref.actor.clip_ratio_c"] == "no dual-clip PPO"
    assert why["actor_rollout_ref.actor.fsdp_config.param_offload"] == MACHINERY
    assert "actor_rollout_ref.rollout.prompt_length" not in why  # ${oc.select:data.max_prompt_length,512}: resolved, same


def test_every_key_set_is_translated_consumed_or_named():
    """No key of the fixture disappears: each is the source of a translated key, read by another key's conversion
    (the table says which), or named with a reason."""
    t = translate(verl())
    sources = set(t.source.values())
    named = {key for key, _, _ in t.untranslated}
    consumed = {"actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.kl_loss_coef",
                "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "algorithm.norm_adv_by_std_in_grpo",
                "custom_reward_function.name", "trainer.nnodes", "actor_rollout_ref.rollout.val_kwargs.do_sample",
                "actor_rollout_ref.rollout.prompt_length", "actor_rollout_ref.rollout.response_length"}
    fixed_ok = {"data.prompt_key", "data.reward_fn_key", "data.truncation", "actor_rollout_ref.model.lora_rank",
                "actor_rollout_ref.actor.kl_loss_type", "actor_rollout_ref.rollout.val_kwargs.top_k",
                "algorithm.use_kl_in_reward", "trainer.val_before_train"}  # verl values that are this project's own
    kwargs = {k for k in flatten(verl()) if ".reward_kwargs." in k}
    assert set(flatten(verl())) - sources - named - consumed - fixed_ok - kwargs == set()


@pytest.mark.parametrize(
    ("change", "key", "why"),
    [
        ({"algorithm": {"adv_estimator": "gae"}}, "algorithm.adv_estimator", "only group-relative estimators"),
        ({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 24}}}, "actor_rollout_ref.actor.ppo_mini_batch_size",
         "data.train_batch_size=64 is not a multiple of it"),
        ({"actor_rollout_ref": {"actor": {"use_dynamic_bsz": False}}}, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
         "verl uses it only with actor.use_dynamic_bsz=true"),
        ({"actor_rollout_ref": {"actor": {"loss_agg_mode": "seq-mean-token-sum"}}}, "actor_rollout_ref.actor.loss_agg_mode",
         "the loss is a token mean or a per-sequence mean (translated: token-mean, seq-mean-token-mean)"),
        ({"actor_rollout_ref": {"rollout": {"name": "sglang"}}}, "actor_rollout_ref.rollout.name", "rollout engines here"),
        ({"actor_rollout_ref": {"rollout": {"response_length": 256}}}, "actor_rollout_ref.rollout.response_length",
         "conflicts with data.max_response_length (already rollout.max_tokens=1024)"),
        ({"data": {"truncation": "left"}}, "data.truncation", "prompts are never truncated here"),
        ({"reward_model": {"enable": True}}, "reward_model.enable", "no model-based reward"),
        ({"trainer": {"logger": ["console", "mlflow"]}}, "trainer.logger", "not mlflow"),
        ({"critic": {"optim": {"lr": 1e-5}}}, "critic.optim.lr", "GRPO/DAPO train no critic"),
        ({"trainer": {"total_training_steps": 100}}, "trainer.total_epochs", "trainer.total_training_steps is set"),
        ({"defaults": ["ppo_trainer"]}, "defaults", "a Hydra defaults list"),
    ],
)
def test_what_cannot_be_translated_is_named_with_its_reason(change, key, why):
    cfg = verl()
    for section, sub in change.items():
        cfg[section] = _merged(cfg.get(section), sub)
    found = [(k, r) for k, _, r in translate(cfg).untranslated if k == key]
    assert found and why in found[0][1], found


def _merged(base, sub):
    if not isinstance(base, dict) or not isinstance(sub, dict):
        return sub
    out = dict(base)
    for k, v in sub.items():
        out[k] = _merged(base.get(k), v)
    return out


def test_dapo_keys_and_unset_values():
    t = translate({"algorithm": {"adv_estimator": "grpo", "filter_groups": {"enable": True, "max_num_gen_batches": 5,
                                                                            "metric": "acc"}},
                   "reward_model": {"reward_manager": "dapo", "overlong_buffer": {"enable": True, "len": 512,
                                                                                  "penalty_factor": 1.0}},
                   "data": {"train_files": "a.parquet", "val_files": None},
                   "trainer": {"total_training_steps": 200, "save_freq": -1, "test_freq": -1}})
    assert t.keys == {"algorithm.advantage": "grpo", "algorithm.dynamic_sampling.enabled": True,
                      "algorithm.dynamic_sampling.max_rounds": 5, "algorithm.overlong.enabled": True,
                      "algorithm.overlong.buffer": 512, "algorithm.overlong.factor": 1.0, "task.name": "dataset",
                      "task.dataset.train_files": ["a.parquet"], "run.steps": 200, "run.checkpoint_every": 0,
                      "task.dataset.val_every": 0,
                      "reward.function": "dynaresize.rewards.math:compute_score"}  # verl's default reward: built-in math
    assert [k for k, _, _ in t.untranslated] == ["algorithm.filter_groups.metric"]  # val_files: null is not set


def test_the_command_writes_the_config_and_prints_what_it_left(tmp_path, capsys):
    out = tmp_path / "from-verl.yaml"
    rc = cli(["config", "from-verl", str(FIXTURE), "trainer.n_gpus_per_node=4", "+data.seed=7", "-o", str(out)])
    err = capsys.readouterr().err
    text = out.read_text()
    assert "not translated: actor_rollout_ref.actor.clip_ratio_c = 3.0: no dual-clip PPO" in err
    assert ("not translated: 2 key(s) under actor_rollout_ref.actor (fsdp_config.param_offload, "
            "fsdp_config.optimizer_offload): verl's machinery") in err
    assert "#   actor_rollout_ref.actor.clip_ratio_c = 3.0: no dual-clip PPO" in text  # named in the file too
    data = yaml.safe_load(text)
    assert data["cluster"] == {"gpus": 4, "gpus_per_node": 4} and data["run"]["seed"] == 7  # the overrides applied
    assert "  lr: 1.0e-06  # verl: actor_rollout_ref.actor.optim.lr" in text.splitlines()
    assert f"wrote {out}: " in err and rc == 1  # the fixture's data files (~/data/gsm8k) are not on this machine
    assert "no such dataset file" in err


def verl_parquet(path: Path, n: int) -> Path:
    """``n`` rows in the layout verl's gsm8k preprocessing writes (data_source, chat prompt, reward_model)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": path.stem, "index": i}} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_the_translated_config_loads_with_the_projects_loader(tmp_path, capsys):
    """`dynaresize config check` accepts the output, every RL knob arriving under its own key."""
    train, val = verl_parquet(tmp_path / "train.parquet", 130), verl_parquet(tmp_path / "test.parquet", 8)
    out = tmp_path / "from-verl.yaml"
    rc = cli(["config", "from-verl", str(FIXTURE), f"data.train_files={train}", f"data.val_files={val}", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    cfg = load_config(out)
    assert (cfg.train.mini_batches, cfg.train.epochs, cfg.algorithm.advantage) == (4, 2, "grpo_no_std")
    assert cfg.reward.kwargs == {"method": "flexible", "format_score": 0.1} and cfg.rollout.max_prompt_tokens == 512
    assert cfg.run.steps == 130 // 64 * 15  # trainer.total_epochs over verl's drop_last batches of the file
    assert cli(["config", "check", str(out)]) == 0


def test_the_docs_table_is_the_codes():
    doc = (ROOT / "docs" / "from-verl.md").read_text()
    assert markdown_table() in doc, "docs/from-verl.md's table differs from dynaresize.config.from_verl.TABLE"
    assert TABLE[-1].verl == "*"  # every key meets a rule


def test_hydra_leftovers_are_named_not_fatal():
    """What a dumped Hydra config holds: class paths, mandatory '???', relative and chained interpolations."""
    t = translate({"actor_rollout_ref": {
        "actor": {"_target_": "verl.workers.config.FSDPActorConfig", "ppo_epochs": 1,
                  "checkpoint": {"save_contents": ["model", "optimizer"], "load_contents": "${.save_contents}"}},
        "rollout": {"name": "???", "n": "${oc.select:actor_rollout_ref.rollout.m,4}",
                    "log_prob_use_dynamic_bsz": "${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}"}}})
    assert t.keys == {"train.epochs": 1, "rollout.group_size": 4}  # the select's default; '???' is not set
    why = {k: r for k, _, r in t.untranslated}
    assert why["actor_rollout_ref.actor._target_"] == MACHINERY
    assert why["actor_rollout_ref.actor.checkpoint.load_contents"] == ("an interpolation this translator cannot "
                                                                        "resolve: give the value")
    assert "actor_rollout_ref.rollout.name" not in why
