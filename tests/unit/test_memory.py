"""The memory model (dynaresize/memory.py, docs/memory.md): its parameter count against the HF models it describes,
its saved activations against what autograd keeps, its model states against DeepSpeed's own estimator (within 5%),
and the places that obey it: config check (the table, one-line errors for bad input), the policy's candidates."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dynaresize.config.loader import ConfigError, load_config
from dynaresize.config.memory import check_config, format_table, memory_report
from dynaresize.memory import (GIB, Architecture, MemoryModelError, Settings, activations, load_architecture,
                               model_states, plan)
from dynaresize.policy import ResizeAction, Topology, candidate_topologies

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = ROOT / "configs/models/qwen3-8b/config.json"
SMALL = {"model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 768, "vocab_size": 1000,
         "tie_word_embeddings": False}


def hf_model(d: dict, device: str = "cpu"):
    import torch
    import transformers as T

    kind = d.get("model_type", "llama")
    cfg_cls, model_cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
                          "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM)}[kind]
    cfg = cfg_cls(**{k: v for k, v in d.items() if k != "model_type"}, attn_implementation="sdpa")
    with torch.device(device):
        return model_cls(cfg)


def test_qwen3_8b_fixture_holds_the_public_architecture():
    a = load_architecture(QWEN3_8B)
    assert (a.layers, a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate, a.vocab, a.tied, a.dtype) == \
        (36, 4096, 32, 8, 128, 12288, 151936, False, "bfloat16")
    assert a.params == 8_190_735_360  # Qwen3-8B's parameter count
    assert a.kv_bytes_per_token(2) == 36 * 2 * 8 * 128 * 2 == 147456  # = configs/emulated-8gpu.yaml's sim figure


@pytest.mark.parametrize("d", [
    SMALL, {**SMALL, "model_type": "qwen2", "head_dim": None}, {**SMALL, "model_type": "llama", "head_dim": None},
    {**SMALL, "model_type": "llama", "tie_word_embeddings": True, "head_dim": None},
])
def test_parameter_count_is_the_hf_models(d):
    d = {k: v for k, v in d.items() if v is not None}
    m = hf_model(d, "meta")
    assert Architecture.from_config(d).params == sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_saved_activations_are_what_autograd_keeps(kind, precision):
    import torch

    d = {**SMALL, "model_type": kind}
    if kind != "qwen3":
        d.pop("head_dim")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    arch = Architecture.from_config(d)
    per_layer, outside = arch.saved_per_token(2 if precision == "bf16" else 4)
    n_tok = 2 * 64
    got = {}
    for layers in (1, 2):
        m = hf_model({**d, "num_hidden_layers": layers}).to(dtype)
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            k = t.untyped_storage().data_ptr()
            if k not in params:
                seen[k] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(input_ids=torch.randint(0, 1000, (2, 64)))
        got[layers] = sum(seen.values()) / n_tok
    assert got[2] - got[1] == per_layer  # exactly, per layer
    # outside the layers: the final norm, ids, the rotary tables (per position, not modelled: < 1%)
    assert got[1] - per_layer == pytest.approx(outside, rel=0.05)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_model_states_match_deepspeeds_zero2_estimator(n, capsys):
    from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs_all_cold,
                                                      estimate_zero2_model_states_mem_needs_all_live)

    def ds_gpu_bytes() -> float:  # the 'per GPU' figure of the offload_optimizer=none row, GB as it prints (2^30)
        row = next(ln for ln in capsys.readouterr().out.splitlines() if "offload_optimizer=none" in ln)
        return float(re.findall(r"([\d.]+)GB", row)[1]) * GIB

    s = Settings(precision="bf16", zero_stage=2)
    # live: a real (small) model, DeepSpeed counts its parameters itself
    arch = Architecture.from_config(SMALL)
    estimate_zero2_model_states_mem_needs_all_live(hf_model(SMALL), num_gpus_per_node=n)
    ours = sum(p.bytes for p in model_states(arch, s, n) if not p.host)
    assert ours == pytest.approx(ds_gpu_bytes(), rel=0.05, abs=0.01 * GIB)
    # cold: Qwen3-8B's count
    big = load_architecture(QWEN3_8B)
    estimate_zero2_model_states_mem_needs_all_cold(big.params, num_gpus_per_node=n)
    ours = sum(p.bytes for p in model_states(big, s, n))
    assert ours == pytest.approx(ds_gpu_bytes(), rel=0.05)


def test_zero1_keeps_gradients_whole_and_checkpointing_saves_activations():
    a, s = load_architecture(QWEN3_8B), Settings(precision="bf16", zero_stage=1, micro_batch_tokens=4096)
    z1 = {p.name: p.bytes for p in model_states(a, s, 4)}
    z2 = {p.name: p.bytes for p in model_states(a, Settings(zero_stage=2), 4)}
    assert z1["gradients"] == 4 * z2["gradients"] == 2 * a.params
    off = activations(a, s, 4096).bytes
    on = activations(a, Settings(activation_checkpointing=True), 4096).bytes
    head = a.loss_head_per_token() * 4096
    assert head < on < off  # the logits stay: checkpointing saves the layers' activations only
    assert a.loss_head_per_token() == 12 * 151936  # three fp32 [tokens, vocab] tensors at the backward's start


def run_check(*overrides: str, config: str = "configs/gpu-8x1.yaml") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynaresize.cli", "config", "check", config, *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_config_check_prints_the_8b_table_on_80_and_96_gb():
    for gb in (80, 96):
        p = run_check(f"cluster.gpu_memory_gb={gb}")
        assert p.returncode == 0, p.stderr
        assert "8.19B params" in p.stdout and "trainer GiB" in p.stdout
        assert "feasible splits: 3:5, 4:4, 5:3, 6:2, 7:1" in p.stdout, p.stdout
        row = next(ln for ln in p.stdout.splitlines() if ln.strip().startswith("1:7"))
        assert " no " in row and "more trainers (3)" in row


def test_config_check_refuses_an_initial_split_that_does_not_fit_in_one_line():
    p = run_check("cluster.initial_train=1")
    assert p.returncode == 2
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "cluster.initial_train=1" in err and "163.2 GiB of a 74.5 GiB GPU" in err and "adam moments 61.0" in err
    assert "splits that fit: 3..7 trainers" in err


def test_bad_memory_inputs_are_one_message_each(tmp_path):
    # a micro-batch below one sequence is the config's own rule (schema.py), refused at load
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens = 1000: a micro-batch must hold one whole sequence.*2049"):
        load_config("configs/gpu-8x1.yaml", ["train.micro_batch_tokens=1000"])
    broken = tmp_path / "config.json"
    broken.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    cfg = load_config("configs/gpu-8x1.yaml", [f"model.architecture={tmp_path}"])
    with pytest.raises(ConfigError, match=r"needs num_hidden_layers \(layers\), intermediate_size .*vocab_size"):
        check_config(cfg)
    with pytest.raises(MemoryModelError, match="no config.json"):
        load_architecture(tmp_path / "nowhere")
    # no architecture here (model.path on the cluster only) and no capacity: the table says so, nothing refused
    cfg = load_config("configs/gpu-8x1.yaml", ["model.architecture=null", "cluster.gpu_memory_gb=null"])
    rep = check_config(cfg, read_device=lambda: None)
    assert rep.table is None and "not on this host" in format_table(rep)
    rep = check_config(load_config("configs/quickstart.yaml"))
    assert "not checked (no memory figure for cluster.device=cpu" in format_table(rep)


def test_a_model_that_fits_no_split_is_refused_with_figures():
    cfg = load_config("configs/gpu-8x1.yaml", ["cluster.gpu_memory_gb=24"])
    with pytest.raises(ConfigError, match=r"no split of 8 GPUs fits 22.4 GiB.*adam moments 8.7.*ZeRO-3/FSDP"):
        check_config(cfg)
    # the model states fit, a whole slice's activations do not: the message says what would fit, not ZeRO-3
    cfg = load_config("configs/gpu-8x1.yaml", ["train.micro_batch_tokens=null", "train.activation_checkpointing=false"])
    with pytest.raises(ConfigError, match=r"activations do not fit; would fit with: train.micro_batch_tokens <= \d+$"):
        check_config(cfg)
    cfg = load_config("configs/gpu-8x1.yaml", ["rollout.vllm.gpu_memory_utilization=0.99"])
    with pytest.raises(ConfigError, match=r"a rollout rank needs 74.8 GiB \(weights 15.3, kv cache"):
        check_config(cfg)


def test_policy_candidates_are_the_feasible_splits_only():
    from tests.unit.test_policy import obs, policy

    feasible = {n for n in range(1, 8) if n != 5}
    assert Topology(5, 3) not in candidate_topologies(8, feasible=feasible)
    # the worked example of test_policy: from 6:2 the fastest predicted split is 5:3; it does not fit, so 4:4
    for cands, want in ((candidate_topologies(8), Topology(5, 3)), (candidate_topologies(8, feasible=feasible), Topology(4, 4))):
        p = policy(min_dwell_steps=0, tail_cv_prior=0.0)
        p.candidates = cands
        s = p.initial_state()
        s, _ = p.step(s, obs(0, Topology(6, 2), 200, 100, tail=40))
        s, d = p.step(s, obs(1, Topology(6, 2), 200, 100, tail=40))
        assert d.action is ResizeAction.RESIZE and d.target == want


def test_plan_of_the_8b_job():
    cfg = load_config("configs/gpu-8x1.yaml")
    t = memory_report(cfg).table
    assert t.feasible() == (3, 4, 5, 6, 7)
    sp = t.split(4)
    # the figure: ZeRO-2 at 2 trainers ~73 GB of weights, gradient share, master and moments before
    # activations (2 + 14 / n bytes a parameter), plus DeepSpeed's fp32 gradient partition (4 / n)
    p2 = plan(t.arch, t.settings, 8, t.capacity).split(2).trainer
    assert (p2.part("weights") + p2.part("gradients") + p2.part("fp32 master") + p2.part("adam moments")) / 1e9 == \
        pytest.approx(73.7, abs=0.2)
    assert sp.rollout.part("kv cache") == int(0.45 * 80e9) - t.arch.params * 2


def test_run_refuses_a_split_that_does_not_fit_before_any_rank_starts(tmp_path):
    for over, want in ((["cluster.initial_train=1"], "a trainer rank of the split 1:7 needs 163.2 GiB"),
                       (["train.micro_batch_tokens=100"], "train.micro_batch_tokens = 100: a micro-batch must hold one whole sequence")):
        p = subprocess.run([sys.executable, "-m", "dynaresize.cli", "run", "configs/gpu-8x1.yaml", *over,
                            f"run.output_dir={tmp_path}", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and want in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not any(tmp_path.iterdir())  # no run directory, no rank


def test_simulator_plays_the_splits_that_fit():
    from dynaresize.sim.compare import setup

    cfg = load_config("configs/emulated-8gpu.yaml", ["train.zero_stage=1", "sim.steps=4"])
    assert [c.n_train for c in setup(cfg).candidates] == [5, 6, 7]
    cfg = load_config("configs/emulated-8gpu.yaml", ["cluster.gpu_memory_gb=null", "sim.steps=4"])
    assert [c.n_train for c in setup(cfg).candidates] == list(range(1, 8))  # no figure: every split


def test_the_in_memory_snapshots_host_memory_is_own_plus_peers_partition_and_rank0s_weights_twice():
    """faults.snapshot_every (docs/FAULTS.md row 33): host memory, never the device's; none off or with one trainer."""
    from dynaresize.memory import trainer

    a = load_architecture(QWEN3_8B)
    on, off = Settings(precision="bf16", snapshot_every=1), Settings(precision="bf16", snapshot_every=0)
    t4 = trainer(a, on, 4)
    assert t4.part("snapshots") == 2 * (2 * (12 * a.params // 4) + 2 * a.params)
    assert 125 * 1e9 < t4.part("snapshots") < 135 * 1e9  # Qwen3-8B on 4 trainers: the figure docs/memory.md states
    assert t4.device == trainer(a, off, 4).device and t4.host > trainer(a, off, 4).host
    assert trainer(a, on, 1).part("snapshots") == 0 and trainer(a, off, 4).part("snapshots") == 0
