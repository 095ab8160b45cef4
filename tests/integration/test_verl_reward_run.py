"""A verl user's reward function in a run, unchanged: verl-layout Parquet (gsm8k's columns), a gsm8k-style
``compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0)`` given by file path with
verl's ``reward_kwargs``. The run scores by keyword (non-zero rewards: the kwargs arrived); a function that raises on
every sample stops the run with exit 1, one message naming the function, the fraction, the error and the sample, and
a run that is not ``completed``; validation's failures are one console line per pass.

The training file also holds overlong rows (a prompt longer than the model's 256 positions minus rollout.max_tokens):
dropped and counted at load (``rollout.on_overlong: filter``), or the run refused naming file, row and length
(``fail``), before any rank starts.

Real parts: the BYO test's model directory (its own tokenizer and chat template), real Redis, worker processes,
DeepSpeed on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.integration.test_byo import dynaresize_run, jsonl, make_model_dir, question, run_dir

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "tests" / "fixtures" / "verl_style" / "rewards.py"


def gsm8k_records(n: int, split: str) -> list[dict]:
    """The columns verl's examples/data_preprocess/gsm8k.py writes: data_source, prompt (chat), ability,
    reward_model {style, ground_truth}, extra_info {split, index, answer, question}."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question(i)}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i % 10 + (i * 7) % 10)},
             "extra_info": {"split": split, "index": i, "answer": f"#### {i % 10 + (i * 7) % 10}",
                            "question": question(i)}} for i in range(n)]


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl")
    model_dir = make_model_dir(root / "my-model")
    rows = gsm8k_records(32, "train")
    long = [dict(r, prompt=[{"role": "user", "content": " ".join([question(i)] * (20 + i))}]) for i, r in enumerate(rows[:3])]
    pq.write_table(pa.Table.from_pylist(rows + long), root / "train.parquet")  # rows 32..34: overlong
    pq.write_table(pa.Table.from_pylist(gsm8k_records(2, "test")), root / "test.parquet")
    return root, model_dir


def config(root: Path, model_dir: Path, name: str, function: str, kwargs: str = "{}") -> Path:
    lines = [
        f"extends: {ROOT / 'configs' / 'base.yaml'}",
        f"run: {{name: {name}, steps: 2, checkpoint_every: 0, progress: false, output_dir: {root / 'runs' / name}}}",
        "cluster: {gpus: 2, initial_train: 1}",
        "redis: {heartbeat_s: 0.5, dead_after_heartbeats: 8}",
        f"model: {{path: {model_dir}}}",
        "rollout: {prompts_per_step: 4, group_size: 4, max_tokens: 10, pull_batch: 8}",
        "task:", "  name: dataset", "  dataset:",
        f"    train_files: [{root / 'train.parquet'}]", f"    val_files: [{root / 'test.parquet'}]",
        "    val_every: 2", "    val_samples: 2",
        f"reward: {{function: '{FILE}:{function}', kwargs: {kwargs}}}",
    ]
    path = root / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_gsm8k_style_function_scores_by_keyword_in_a_run(gsm8k):
    root, model_dir = gsm8k
    out = dynaresize_run(root, config(root, model_dir, "gsm8k", "gsm8k_score", "{method: flexible, format_score: 0.1}"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    d = run_dir(root, "gsm8k")
    rewards = [r for b in jsonl(d / "batches.jsonl") for r in b["rewards"]]
    assert len(rewards) == 2 * 16 and set(rewards) <= {0.0, 0.1, 1.0}
    assert sum(rewards) > 0, "every sample scored 0: the function was not called as verl calls it"
    assert not [e for e in jsonl(d / "events.jsonl") if e.get("what") == "reward_error"]
    assert all(v["reward_errors"] == 0 for v in jsonl(d / "validation.jsonl"))
    assert json.loads((d / "summary.json").read_text())["status"] == "completed"
    # the overlong rows were dropped at load, counted on the console and in the event log
    (line,) = [line for line in out.stderr.splitlines() if "rollout.on_overlong=filter" in line]
    assert f"3 of 35 train prompts dropped (the longest " in line and f"{root / 'train.parquet'}: row 34)" in line
    assert line.endswith("longer than 246 tokens (the model's context (max_position_embeddings) 256 - rollout.max_tokens 10)")
    (ev,) = [e for e in jsonl(d / "events.jsonl") if e.get("what") == "prompts_filtered"]
    assert ev["dropped"] == {"train": 3} and ev["kept"] == {"train": 32} and ev["limit"] == 246


def test_an_overlong_prompt_with_on_overlong_fail_is_refused_before_any_rank(gsm8k):
    root, model_dir = gsm8k
    out = dynaresize_run(root, config(root, model_dir, "overlong", "gsm8k_score"), "rollout.on_overlong=fail", timeout=300)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    (line,) = [line for line in out.stderr.splitlines() if line.strip()]
    assert line.startswith(f"dynaresize run: {root / 'train.parquet'}: row 32: field 'prompt': ")
    assert line.endswith("tokens, longer than 246 (the model's context (max_position_embeddings) 256 - rollout.max_tokens "
                         "10); 3 of 35 train prompts are; set rollout.on_overlong=filter to drop them")
    assert not list((root / "runs" / "overlong").glob("*/worker-*"))


def test_a_function_that_always_raises_stops_the_run_with_one_message(gsm8k):
    root, model_dir = gsm8k
    out = dynaresize_run(root, config(root, model_dir, "raises", "always_raises"))
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "completed" not in out.stdout
    (stop,) = [line for line in out.stderr.splitlines() if "reward.max_error_fraction" in line]
    assert stop.startswith("dynaresize run: batch 0: the reward failed on ")
    assert "> reward.max_error_fraction=0.5); stopped instead of training on zeros. First failure: sample 0." in stop
    assert stop.endswith(f"reward {FILE}:always_raises raised AssertionError: (no message)")
    # validation at version 0 ran before: its failures are one console line
    (val,) = [line for line in out.stderr.splitlines() if line.startswith("WARNING") and "validation at version 0" in line]
    assert "4 of 4 reward(s) failed and scored 0" in val
    assert not [line for line in out.stderr.splitlines() if "batch 0:" in line and line.startswith("WARNING")]
    d = run_dir(root, "raises")
    (end,) = [e for e in jsonl(d / "events.jsonl") if e.get("type") == "run_end"]
    assert end["status"] == "failed" and not (d / "batches.jsonl").exists() or not jsonl(d / "batches.jsonl")
