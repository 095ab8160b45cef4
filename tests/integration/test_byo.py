"""Bring your own model, data and reward, end to end: what a user with a local HF directory and a Parquet file does.

The model directory is built here the way any HF model is laid out, and deliberately unlike the built-in tiny model:
a SentencePiece-style Unigram tokenizer (Metaspace, ``<s>``/``</s>``, no pad token), its own chat template, a
``generation_config.json``. The data is a Parquet file of chat prompts in verl's layout; the reward is a function in
a user module given by import path. The job (real Redis, 4 worker processes, DeepSpeed on CPU) must:

- render every prompt with the directory's chat template (the coordinator logs the first one, decoded);
- hand each record's ground truth, data source and extra info to the reward on the rollout ranks;
- survive a reward that raises (scored 0, reported with its sample key);
- measure the validation reward (mean and pass@k) before the first and after the last step;
- train on the same samples (keys, versions, rewards) and measure the same validation rewards whether the split
  changes during the run or stays put, with DAPO dynamic sampling on (the kept groups are chosen by prompt order).

Bad set-ups (no chat template with chat data, a malformed record, a directory that is not a model) fail the CLI
within seconds, before any rank starts, with one message naming the path, row and field.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ("{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>[assistant]{% endif %}")
B, G, STEPS, VAL_K = 4, 4, 4, 2

SPY_REWARD = '''
import json, os
from dynaresize.rewards.math import compute_score

def spy(data_source, solution_str, ground_truth, extra_info):
    """Logs what reached it; raises for one record; otherwise the math score plus a length term (so groups differ)."""
    with open(os.environ["BYO_SPY_LOG"], "a") as f:
        f.write(json.dumps({"data_source": data_source, "ground_truth": ground_truth, "extra_info": extra_info}) + "\\n")
    if extra_info.get("split") == "train" and extra_info.get("index") == int(os.environ["BYO_CURSED"]):
        raise ValueError("this record is cursed")
    return compute_score(data_source, solution_str, ground_truth) + 0.1 * (len(solution_str) % 5)
'''


def question(i: int) -> str:
    return f"Ann has {i % 10} pens and buys {(i * 7) % 10} more. How many pens now?"


def records(n: int, split: str) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": question(i)}], "data_source": "byo_toy",
             "reward_model": {"style": "rule", "ground_truth": str(i % 10 + (i * 7) % 10)},
             "extra_info": {"split": split, "index": i}} for i in range(n)]


def make_model_dir(path: Path) -> Path:
    """A tiny Llama with a Unigram tokenizer of its own (no pad token), its chat template and generation config."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = [question(i) + f" The answer is {i % 19}." for i in range(300)] + ["[user] [assistant] \\boxed{}"] * 10
    tok.train_from_iterator(corpus, trainers.UnigramTrainer(vocab_size=160, special_tokens=["<s>", "</s>", "<unk>"],
                                                             unk_token="<unk>", show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", padding_side="left")
    hf.chat_template = TEMPLATE
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(hf), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id, dtype="float32")
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = [hf.eos_token_id]
    model.save_pretrained(path)
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def byo(tmp_path_factory):
    root = tmp_path_factory.mktemp("byo")
    model_dir = make_model_dir(root / "my-model")
    pq.write_table(pa.Table.from_pylist(records(40, "train")), root / "train.parquet")
    pq.write_table(pa.Table.from_pylist(records(3, "val")), root / "val.parquet")
    (root / "my_rewards.py").write_text(SPY_REWARD)
    return root, model_dir


def dataset_config(path: Path, model_dir: Path, *, val_every: int, val_samples: int, **sections: str) -> Path:
    """Write a run config at ``path`` on ``path.parent``'s train.parquet and val.parquet and the model in
    ``model_dir`` (base.yaml, a short heartbeat), validation every ``val_every`` versions with ``val_samples``
    samples a prompt; ``sections`` are the test's own top-level sections (name -> YAML flow value)."""
    root = path.parent
    lines = [
        f"extends: {ROOT / 'configs' / 'base.yaml'}",
        "redis: {heartbeat_s: 0.5, dead_after_heartbeats: 8}",
        f"model: {{path: {model_dir}}}",
        "task:", "  name: dataset", "  dataset:",
        f"    train_files: [{root / 'train.parquet'}]", f"    val_files: [{root / 'val.parquet'}]",
        f"    val_every: {val_every}", f"    val_samples: {val_samples}",
        *[f"{k}: {v}" for k, v in sections.items()],
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def config(root: Path, model_dir: Path, name: str) -> Path:
    return dataset_config(
        root / f"{name}.yaml", model_dir, val_every=2, val_samples=VAL_K,
        run=f"{{name: {name}, steps: {STEPS}, checkpoint_every: 0, progress: false, output_dir: {root / 'runs' / name}}}",
        cluster="{gpus: 4, initial_train: 2}",
        rollout=f"{{prompts_per_step: {B}, group_size: {G}, max_tokens: 10, pull_batch: 8}}",
        reward="{function: 'my_rewards:spy', on_error: zero}",
        algorithm="{dynamic_sampling: {enabled: true, max_rounds: 2, round_prompts: 2}}")


def dynaresize_run(root: Path, cfg: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(root), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               BYO_SPY_LOG=str(root / f"spy-{cfg.stem}.jsonl"), BYO_CURSED=str(cursed_row()))
    return subprocess.run([sys.executable, "-m", "dynaresize.cli", "run", str(cfg), *overrides, "--quiet"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def cursed_row(seed: int = 5) -> int:
    """The training record of step 0's first sample for run.seed=5: the spy reward raises on it."""
    from dynaresize.tasks.dataset import record_index

    return record_index(40, True, seed, 0, 0, B)


def run_dir(root: Path, name: str) -> Path:
    (d,) = [p for p in (root / "runs" / name).iterdir() if p.is_dir()]
    return d


def jsonl(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_work_items_render_the_directorys_chat_template(byo):
    """In process: the ids a rollout rank gets are the directory's own apply_chat_template output."""
    from dynaresize.config.loader import load_config
    from dynaresize.job.batching import work_items
    from dynaresize.models import load_tokenizer
    from dynaresize.tasks import load_task

    root, model_dir = byo
    cfg = load_config(config(root, model_dir, "inproc"))
    tok, task = load_tokenizer(model_dir), load_task(cfg.task)
    items, texts = work_items(task, tok, 0, 0, B, G)
    first = task.sample(0, 0, 0, B)
    expected = tok.apply_chat_template(first.prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert items[0].prompt_ids == list(expected) and texts[0] == first.prompt[0]["content"]
    assert tok.decode(items[0].prompt_ids).startswith("<s> [user]") and tok.pad_token_id is None  # pad falls back to EOS
    assert items[0].info == {"data_source": "byo_toy", "ground_truth": first.ground_truth, "extra_info": first.extra_info}


def test_byo_job_resized_and_static_train_on_the_same_samples(byo):
    """The barrier-free schedule resizing both ways, with DAPO dynamic sampling, clip-higher and validation on, against
    the static barrier run with the same seed."""
    root, model_dir = byo
    steps = "run.steps=6"
    clip = "train.clip_eps_high=0.28"
    dyn = dynaresize_run(root, config(root, model_dir, "dyn"), "policy.forced_splits={1: 1, 3: 3}", "run.seed=5", steps,
                         clip, "pipeline.schedule=barrier_free", "pipeline.groups_per_command=1")
    assert dyn.returncode == 0, dyn.stdout[-3000:] + dyn.stderr[-3000:]
    st = dynaresize_run(root, config(root, model_dir, "static"), "policy.enabled=false", "run.seed=5", steps, clip,
                        "pipeline.schedule=barrier")
    assert st.returncode == 0, st.stdout[-3000:] + st.stderr[-3000:]
    d_dir, s_dir = run_dir(root, "dyn"), run_dir(root, "static")

    # the chat template of the directory was applied to the prompts the model got
    events = jsonl(d_dir / "events.jsonl")
    (shown,) = [e for e in events if e.get("what") == "prompt_rendered"]
    from dynaresize.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    first = records(40, "train")[cursed_row()]["prompt"]
    ids = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert shown["key"] == "0.0.0" and shown["reason"] == tok.decode(ids)
    assert shown["reason"].startswith("<s> [user] Ann has") and shown["reason"].endswith("</s><s> [assistant]")

    # ground truth, data source and extra info reached the reward on the rollout ranks, for every sample
    spy = jsonl(root / "spy-dyn.jsonl")
    train_rows, val_rows = records(40, "train"), records(3, "val")
    assert len(spy) >= STEPS * B * G + 3 * VAL_K  # training samples and validation passes (version 0 at least)
    for call in spy:
        rows = train_rows if call["extra_info"]["split"] == "train" else val_rows
        row = rows[call["extra_info"]["index"]]
        assert call["data_source"] == "byo_toy" and call["ground_truth"] == row["reward_model"]["ground_truth"]

    # a reward that raised: scored 0, reported with its sample key, the run went on
    errors = [e for e in events if e.get("what") == "reward_error"]
    b_dyn, b_st = jsonl(d_dir / "batches.jsonl"), jsonl(s_dir / "batches.jsonl")
    assert [e["reason"].split(":")[0] for e in errors][:G] == [f"sample 0.0.{i}" for i in range(G)]  # step 0, prompt 0
    assert all("reward my_rewards:spy raised ValueError: this record is cursed" in e["reason"] for e in errors)
    # dynamic sampling is on: that group's rewards are all 0, so it is dropped and a later prompt takes its place
    assert not any(k.startswith("0.0.") for k in b_dyn[0]["keys"]) and len(b_dyn[0]["keys"]) == B * G

    # validation measured: versions 0, 2, 4, 6 (every 2 steps and after the last), mean reward and pass@k
    val = jsonl(d_dir / "validation.jsonl")
    assert [v["version"] for v in val] == [0, 2, 4, 6]
    assert all(v["prompts"] == 3 and v["k"] == VAL_K and 0 <= v["pass_at_k"] <= 1 for v in val)
    summary = json.loads((d_dir / "summary.json").read_text())
    assert summary["val_reward_first"] == val[0]["reward_mean"] and summary["val_reward_last"] == val[-1]["reward_mean"]

    # resizing changed no RL result: same samples, versions and rewards; same validation
    n_train = [b["n_train"] for b in b_dyn]
    assert 1 in n_train and 3 in n_train and {b["n_train"] for b in b_st} == {2}, n_train
    for d, s in zip(b_dyn, b_st, strict=True):
        assert d["keys"] == s["keys"] and len(d["keys"]) == B * G
        assert d["versions"] == s["versions"]
        assert d["rewards"] == s["rewards"]
        assert d["loss"] == pytest.approx(s["loss"], rel=1e-3, abs=1e-5)
    ends = [{k: e.get(k) for k in ("step", "groups_kept", "groups_dropped", "groups_generated", "rounds")}
            for e in events if e.get("type") == "step_end"]
    assert ends == [{k: e.get(k) for k in ("step", "groups_kept", "groups_dropped", "groups_generated", "rounds")}
                    for e in jsonl(s_dir / "events.jsonl") if e.get("type") == "step_end"]
    assert any(e["rounds"] for e in ends), "no extra round ran: the test would not exercise dynamic sampling"
    assert [v["reward_mean"] for v in val] == [v["reward_mean"] for v in jsonl(s_dir / "validation.jsonl")]


def _no_chat_template_copy(model_dir: Path, dest: Path) -> Path:
    shutil.copytree(model_dir, dest)
    (dest / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((dest / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (dest / "tokenizer_config.json").write_text(json.dumps(tc))
    return dest


def test_bad_setups_fail_fast_with_one_message(byo, tmp_path):
    root, model_dir = byo
    cfg = config(root, model_dir, "bad")

    bare = _no_chat_template_copy(model_dir, tmp_path / "no-template")
    out = dynaresize_run(root, cfg, f"model.path={bare}", timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"model directory '{bare}': its tokenizer has no chat template" in out.stderr
    assert f"{root / 'train.parquet'}: row 0: field 'prompt' is a list of chat messages" in out.stderr
    assert "Traceback" not in out.stderr

    (tmp_path / "empty").mkdir()
    out = dynaresize_run(root, cfg, f"model.path={tmp_path / 'empty'}", timeout=300)
    assert out.returncode == 2 and f"model.path = '{tmp_path / 'empty'}': no config.json there" in out.stderr

    no_tok = tmp_path / "no-tokenizer"
    shutil.copytree(model_dir, no_tok)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (no_tok / f).unlink()
    out = dynaresize_run(root, cfg, f"model.path={no_tok}", timeout=300)
    assert out.returncode == 2 and f"model.path = '{no_tok}': no tokenizer there" in out.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(records(1, "train")[0]) + "\n" + json.dumps({"prompt": "x", "data_source": "d"}) + "\n")
    out = dynaresize_run(root, cfg, f"task.dataset.train_files=[{bad}]", timeout=300)
    assert out.returncode == 2
    assert f"{bad}: line 2: field 'reward_model': missing or not an object" in out.stderr and "Traceback" not in out.stderr

    out = dynaresize_run(root, cfg, "reward.function=my_rewards:nope", timeout=300)
    assert out.returncode == 2 and "reward.function = 'my_rewards:nope': module 'my_rewards' has no attribute 'nope'" in out.stderr


def test_validation_on_the_barrier_free_schedule_measures_what_the_barrier_run_does(byo):
    """Validation passes as versioned work of the scheduler core: the prompts of version v's pass go to rollout ranks
    holding v, interleaved with the training work (no barrier). With resizing both ways, the run trains the static
    barrier run's samples and measures the same mean reward and pass@k for every validated version."""
    root, model_dir = byo
    no_ds = "algorithm.dynamic_sampling.enabled=false"
    free = dynaresize_run(root, config(root, model_dir, "val-free"), no_ds, "pipeline.schedule=barrier_free", "run.steps=6",
                          "policy.forced_splits={1: 1, 3: 3}", "run.seed=5", "pipeline.groups_per_command=1")
    assert free.returncode == 0, free.stdout[-3000:] + free.stderr[-3000:]
    st = dynaresize_run(root, config(root, model_dir, "val-static"), no_ds, "pipeline.schedule=barrier", "run.steps=6",
                        "policy.enabled=false", "run.seed=5")
    assert st.returncode == 0, st.stdout[-3000:] + st.stderr[-3000:]
    f_dir, s_dir = run_dir(root, "val-free"), run_dir(root, "val-static")
    val_f, val_s = jsonl(f_dir / "validation.jsonl"), jsonl(s_dir / "validation.jsonl")
    assert [v["version"] for v in val_f] == [v["version"] for v in val_s] == [0, 2, 4, 6]
    for f, s in zip(val_f, val_s):
        assert (f["prompts"], f["k"], f["reward_mean"], f["pass_at_k"]) == (s["prompts"], s["k"], s["reward_mean"], s["pass_at_k"])
    # the passes reach the metric loggers too (metrics.jsonl: a line marked validation, against its version)
    logged = [l for l in jsonl(f_dir / "metrics.jsonl") if l.get("validation")]
    assert [(l["step"], l["metrics"]["val/reward_mean"], l["metrics"]["val/pass_at_k"]) for l in logged] == [
        (v["version"], v["reward_mean"], v["pass_at_k"]) for v in val_f]
    b_f, b_s = jsonl(f_dir / "batches.jsonl"), jsonl(s_dir / "batches.jsonl")
    n_train = [b["n_train"] for b in b_f]
    assert 1 in n_train and 3 in n_train, n_train  # resized both ways
    for f, s in zip(b_f, b_s, strict=True):
        assert (f["keys"], f["versions"], f["rewards"]) == (s["keys"], s["versions"], s["rewards"])
    # versioned work interleaved with training: a pass's prompts were handed out while a batch was still generating
    recs = [json.loads(l) for l in (f_dir / "schedule.jsonl").read_text().splitlines()]
    order = [a["type"] for r in recs for a in r.get("actions", []) if a["type"] in ("Validate", "Assign")]
    first_val = [i for i, t in enumerate(order) if t == "Validate"]
    assert first_val and any(t == "Assign" for t in order[first_val[0]:]), order
    assert json.loads((f_dir / "summary.json").read_text())["status"] == "completed"
