"""The trace workload (``sim.workload.trace``, dynaresize/sim/trace.py): a run's logged lengths as the simulator's
batches, the step- and sample-level simulators on them, and one clear error (file, line, key) per bad trace."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dynaresize.config.loader import ConfigError, load_config
from dynaresize.schedule import Mechanisms
from dynaresize.sim.compare import run_samples, run_static, setup
from dynaresize.sim.workload import make_batch

REPO = Path(__file__).parents[2]
TRACE_RUN = REPO / "tests" / "fixtures" / "real_cpu_trace_run"  # `dynaresize run configs/quickstart.yaml run.steps=30`
SIM_CONFIG = REPO / "configs" / "sim" / "cpu_quickstart.yaml"


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(step: int, groups: list[tuple[int, list[int]]]) -> dict:
    """One batches.jsonl line: per group (prompt length, response lengths)."""
    keys, p, r = [], [], []
    for i, (plen, resp) in enumerate(groups):
        for j, n in enumerate(resp):
            keys.append(f"{step}.{i}.{j}")
            p.append(plen)
            r.append(n)
    return {"step": step, "keys": keys, "versions": [step] * len(keys), "rewards": [0.0] * len(keys),
            "prompt_tokens": p, "response_tokens": r, "loss": 0.0, "n_train": 2}


def _cfg(trace: Path, *more: str):
    return load_config(SIM_CONFIG, [f"sim.workload.trace={trace}", "sim.steps=2", *more])


def test_batch_is_the_logged_samples_in_prompt_order_scaled(tmp_path):
    row0 = _row(0, [(7, [3, 1]), (4, [5, 9])])
    # the log's order is not prompt order: the batch puts each prompt's responses together, by index
    perm = [3, 0, 2, 1]
    row0 = {**row0, **{k: [row0[k][i] for i in perm] for k in ("keys", "prompt_tokens", "response_tokens")}}
    f = _write(tmp_path / "batches.jsonl", [row0, _row(1, [(2, [6, 2]), (3, [1, 1])])])
    w = _cfg(tmp_path, "sim.workload.trace_token_scale=2.5").sim.workload  # a run directory names its batches.jsonl
    b = make_batch(w, 0, 0, 2)
    assert b.lengths.tolist() == [8.0, 2.0, 12.0, 22.0]  # 3, 1, 5, 9 x 2.5, rounded (7.5 -> 8, 2.5 -> 2: even)
    assert b.prompt_lengths.tolist() == [18.0, 10.0] and b.prompt_index.tolist() == [0, 0, 1, 1]
    assert b.kept.all() and b.samples == 4 and b.group_size == 2
    assert b.tokens_generated == 44 and b.prompt_tokens == 28
    b1 = make_batch(_cfg(f).sim.workload, 123, 1, 2)  # the seed plays no part
    assert b1.lengths.tolist() == [6.0, 2.0, 1.0, 1.0] and b1.tokens_trained == 10  # cpu_quickstart: response tokens


def test_step_and_sample_level_simulators_run_on_a_real_runs_trace():
    cfg = load_config(SIM_CONFIG, [f"sim.workload.trace={TRACE_RUN}", "sim.steps=30"])
    rows = [json.loads(l) for l in (TRACE_RUN / "batches.jsonl").read_text().splitlines()]
    s = setup(cfg)
    res = run_static(s, s.initial)
    assert res.steps == 30 and res.samples == sum(len(r["keys"]) for r in rows)
    for k, r in enumerate(rows):
        b = s.table.physics(k).batch
        assert sorted(b.lengths.tolist()) == sorted(float(max(n, 1)) for n in r["response_tokens"])
        assert b.tokens_generated == sum(max(n, 1) for n in r["response_tokens"])
        # the empirical rollout of the config prices exactly those tokens
        ro = cfg.sim.rollout
        assert s.table.rollout_s(k, 1) == pytest.approx(ro.empirical_overhead_s + b.tokens_generated / ro.empirical_tokens_per_gpu_s)
    smp = run_samples(s, s.initial, Mechanisms(True, True, False))
    assert smp.samples == res.samples and smp.total_s > 0


def test_trace_errors_name_the_file_the_line_and_the_key(tmp_path):
    good = [_row(0, [(3, [1, 2])]), _row(1, [(3, [1, 2])]), _row(2, [(3, [1, 2])])]

    def err(rows_or_text, *more: str) -> str:
        f = tmp_path / "batches.jsonl"
        if isinstance(rows_or_text, str):
            f.write_text(rows_or_text)
        else:
            _write(f, rows_or_text)
        with pytest.raises(ConfigError) as e:
            _cfg(f, *more)
        return str(e.value)

    missing = tmp_path / "nowhere" / "batches.jsonl"
    with pytest.raises(ConfigError, match=r"sim\.workload\.trace.*nowhere/batches\.jsonl: cannot read the trace"):
        _cfg(missing)
    text = json.dumps(good[0]) + "\n{not json\n"
    assert "batches.jsonl line 2: not a JSON record" in err(text)
    old = {k: v for k, v in good[1].items() if k != "response_tokens"}  # a log from before per-sample lengths
    assert "line 2: no 'response_tokens'" in err([good[0], old])
    short = {**good[1], "prompt_tokens": [3]}
    assert "line 2: 'prompt_tokens' must be 2 token counts >= 0 (one per key)" in err([good[0], short])
    badkey = {**good[1], "keys": ["1.0.0", "x"]}
    assert "line 2: 'keys'[1] = 'x' is not 'step.prompt.index'" in err([good[0], badkey])
    assert "'step' 1 is missing" in err([good[0], good[2]])
    assert "line 2: 'step' 0 appears twice" in err([good[0], good[0]])
    uneven = _row(1, [(3, [1, 2]), (4, [1])])
    assert "line 2: 'keys': prompts with different group sizes [1, 2]" in err([good[0], uneven])
    other_g = _row(1, [(3, [1, 2, 3])])
    assert "line 2: 'keys': group size 3, but 2 on line 1 (rows of different group sizes)" in err([good[0], other_g])
    _write(tmp_path / "batches.jsonl", good)
    with pytest.raises(ConfigError, match=r"sim\.steps.*beyond the trace .*batches\.jsonl \(3 steps\)"):
        _cfg(tmp_path, "sim.steps=4")
    with pytest.raises(ConfigError, match=r"dynamic_sampling.*exclude each other"):
        _cfg(tmp_path, "sim.workload.dynamic_sampling.enabled=true")
    with pytest.raises(ConfigError, match=r"response_tokens_by_step.*exclude each other"):
        _cfg(tmp_path, "sim.workload.response_tokens_by_step=[5]")
    assert np.isclose(make_batch(_cfg(tmp_path).sim.workload, 0, 2, 2).lengths, [1, 2]).all()
