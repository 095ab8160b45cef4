"""The training-inference mismatch figures and truncated importance sampling, against values computed by hand
(dynaresize.rl.mismatch; the worked example of its docstring).

The tiny batch: two sequences of width 4 (position 0 is the prompt), rollout and trainer logprobs

    seq 0: rollout [., -1.0, -2.0, -0.5]  trainer [., -1.1, -1.8, -0.5]   mask [0, 1, 1, 1]
    seq 1: rollout [., -0.3,    .,    .]  trainer [., -0.6,    .,    .]   mask [0, 1, 0, 0]

so d = log pi_train - log pi_rollout = [-0.1, 0.2, 0.0] and [-0.3] (prompt and pad positions hold junk the mask
must drop); |d| mean 0.6 / 4 = 0.15, max 0.3; k3 = e^d - d - 1 = 0.0048374180, 0.0214027582, 0, 0.0408182207.
"""

from __future__ import annotations

import math

import pytest
import torch

from dynaresize.analysis.metrics import analyze, run_mismatch
from dynaresize.analysis.reader import load_run
from dynaresize.analysis.report import render, write_files
from dynaresize.config.loader import ConfigError, load_config
from dynaresize.events import EventLog
from dynaresize.metrics import mismatch_metrics, trainer_metrics
from dynaresize.rl.grpo import GrpoLoss
from dynaresize.rl.mismatch import Mismatch, figures, mismatch, mismatch_stats, reduce_stats, tis_weights

pytestmark = pytest.mark.unit

ROLLOUT = torch.tensor([[9.0, -1.0, -2.0, -0.5], [9.0, -0.3, 4.0, 4.0]])
TRAINER = torch.tensor([[-5.0, -1.1, -1.8, -0.5], [-5.0, -0.6, -7.0, 3.0]])
MASK = torch.tensor([[0.0, 1, 1, 1], [0, 1, 0, 0]])
K3 = [math.exp(-0.1) + 0.1 - 1, math.exp(0.2) - 0.2 - 1, 0.0, math.exp(-0.3) + 0.3 - 1]


def test_mismatch_figures_by_hand():
    m = mismatch(TRAINER, ROLLOUT, MASK)
    assert m.tokens == 4
    assert m.abs_mean == pytest.approx(0.15, abs=1e-7)  # fp32 inputs: -1.1 - -1.0 is -0.1 to ~1e-8
    assert m.abs_max == pytest.approx(0.3, abs=1e-7)
    assert K3 == pytest.approx([0.0048374180, 0.0214027582, 0.0, 0.0408182207], abs=1e-10)
    assert m.k3 == pytest.approx(sum(K3) / 4, rel=1e-5)
    assert m.k3 == pytest.approx(0.0167645992, rel=1e-5)
    # every k3 term is >= 0: symmetric deltas do not cancel (the signed mean of d would be -0.05)
    assert mismatch(torch.tensor([[0.1, -0.1]]), torch.zeros(1, 2), torch.ones(1, 2)).k3 > 0


def test_same_weights_give_zero_and_an_empty_mask_gives_none():
    m = mismatch(ROLLOUT, ROLLOUT, MASK)
    assert (m.abs_sum, m.abs_max, m.k3_sum, m.tokens) == (0.0, 0.0, 0.0, 4.0)
    empty = mismatch(TRAINER, ROLLOUT, torch.zeros_like(MASK))
    assert empty.tokens == 0 and empty.abs_mean is None and empty.k3 is None


def test_parts_add_up_to_the_whole_batch():
    whole = mismatch(TRAINER, ROLLOUT, MASK)
    parts = [mismatch(TRAINER[i:i + 1], ROLLOUT[i:i + 1], MASK[i:i + 1]) for i in range(2)]
    total = parts[0] + parts[1]
    assert total.tokens == whole.tokens and total.abs_max == whole.abs_max
    assert total.abs_sum == pytest.approx(whole.abs_sum, rel=1e-12)
    assert total.k3_sum == pytest.approx(whole.k3_sum, rel=1e-12)
    assert Mismatch.from_stats(whole.stats()) == whole
    assert Mismatch.total([None, parts[0], None, parts[1]]) == total and Mismatch.total([None]) is None


def test_same_version_figures_cover_only_the_samples_of_the_trainers_version():
    s = mismatch_stats(TRAINER, ROLLOUT, MASK, version_lag=torch.tensor([0, 1]))
    f = figures(s)
    assert f["mismatch/tokens"] == 4 and f["mismatch/abs_mean"] == pytest.approx(0.15, abs=1e-7)
    assert f["mismatch/same_version_tokens"] == 3  # sequence 0 only
    assert f["mismatch/same_version_abs_mean"] == pytest.approx(0.1, abs=1e-7)
    assert f["mismatch/same_version_abs_max"] == pytest.approx(0.2, abs=1e-7)
    assert f["mismatch/same_version_k3"] == pytest.approx(sum(K3[:3]) / 3, rel=1e-5)
    # every sample one version behind: no same-version figures at all (absent, not 0)
    none = figures(mismatch_stats(TRAINER, ROLLOUT, MASK, version_lag=torch.tensor([1, 1])))
    assert "mismatch/abs_mean" in none and not any(k.startswith("mismatch/same_version") for k in none)


def test_trainers_reduce_by_sum_and_max():
    # two trainers, one sequence each: the step's figures are the whole batch's
    acks = [{"metrics": mismatch_stats(TRAINER[i:i + 1], ROLLOUT[i:i + 1], MASK[i:i + 1])} for i in range(2)]
    m = mismatch_metrics(acks)
    assert m["mismatch/tokens"] == 4
    assert m["mismatch/abs_mean"] == pytest.approx(0.15, abs=1e-7)
    assert m["mismatch/abs_max"] == pytest.approx(0.3, abs=1e-7)  # rank 1's max
    assert m["mismatch/k3"] == pytest.approx(sum(K3) / 4, rel=1e-5)
    assert {k: v for k, v in trainer_metrics(acks).items() if k.startswith("mismatch/")} == m  # what the loggers get
    # an ack without the figures (an old rank, a token-NLL loss) makes no partial figure
    assert mismatch_metrics([acks[0], {"metrics": {"loss": 1.0}}]) == {}
    assert reduce_stats([]) == {} and mismatch_metrics([]) == {}


def test_tis_weights_by_hand():
    # exp(d) = [0.904837, 1.221403, 1] and [0.740818]; cap 1.1
    w = tis_weights(TRAINER, ROLLOUT, MASK, cap=1.1, level="token")
    assert w[0, 1:].tolist() == pytest.approx([math.exp(-0.1), 1.1, 1.0], rel=1e-6)
    assert w[1, 1].item() == pytest.approx(math.exp(-0.3), rel=1e-6)
    assert w[:, 0].tolist() == [0.0, 0.0] and w[1, 2:].tolist() == [0.0, 0.0]  # off the mask: 0
    # sequence level: seq 0's ratio exp(0.1) = 1.105171 is capped to 1.1 on all its tokens, seq 1 keeps exp(-0.3)
    ws = tis_weights(TRAINER, ROLLOUT, MASK, cap=1.1, level="sequence")
    assert ws[0, 1:].tolist() == pytest.approx([1.1] * 3, rel=1e-6)
    assert ws[1].tolist() == pytest.approx([0.0, math.exp(-0.3), 0.0, 0.0], rel=1e-6)
    # huge log-ratios never overflow (log-space cap)
    big = tis_weights(torch.tensor([[0.0, 800.0]]), torch.tensor([[0.0, -800.0]]), torch.tensor([[0.0, 1.0]]), cap=2.0)
    assert big.tolist() == [[0.0, 2.0]]
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="TIS cap"):
            tis_weights(TRAINER, ROLLOUT, MASK, cap=bad)
    with pytest.raises(ValueError, match="TIS level"):
        tis_weights(TRAINER, ROLLOUT, MASK, cap=2.0, level="geometric")  # type: ignore[arg-type]


def _batch() -> dict[str, torch.Tensor]:
    return {"response_mask": MASK, "old_logprobs": ROLLOUT * MASK, "advantages": torch.tensor([1.0, -2.0])}


def _loss_and_grad(loss_fn: GrpoLoss) -> tuple[float, list[float], dict]:
    logp = (TRAINER * MASK).clone().requires_grad_(True)
    loss, metrics = loss_fn.from_logprobs(logp, _batch())
    loss.backward()
    return float(loss.detach()), logp.grad.tolist(), metrics


def test_tis_token_loss_and_gradient_by_hand():
    # ratio against pi_train is 1 (no clip): per-token loss -A w; token norm over 4 tokens
    # seq 0 (A = 1): -0.904837, -1.1, -1.0; seq 1 (A = -2): +2 x 0.740818 = 1.481636 -> sum -1.523201, / 4
    loss, grad, m = _loss_and_grad(GrpoLoss(tis_cap=1.1))
    w = [math.exp(-0.1), 1.1, 1.0, math.exp(-0.3)]
    assert loss == pytest.approx((-(w[0] + w[1] + w[2]) + 2 * w[3]) / 4, rel=1e-6)
    assert loss == pytest.approx(-0.380800, abs=1e-6)
    # d loss / d logp = -A w / 4 on the response tokens, 0 elsewhere
    assert grad[0] == pytest.approx([0.0, -w[0] / 4, -w[1] / 4, -w[2] / 4], rel=1e-6)
    assert grad[1] == pytest.approx([0.0, 2 * w[3] / 4, 0.0, 0.0], rel=1e-6)
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == 1.0
    assert figures(m)["tis/weight_mean"] == pytest.approx(sum(w) / 4, rel=1e-6)
    assert figures(m)["tis/capped_frac"] == 0.25


def test_tis_sequence_loss_by_hand():
    # seq 0: weight 1.1 on 3 tokens with A = 1 -> -3.3; seq 1: +2 x 0.740818 -> (-3.3 + 1.481636) / 4
    loss, grad, m = _loss_and_grad(GrpoLoss(tis_cap=1.1, tis_level="sequence"))
    assert loss == pytest.approx((-3.3 + 2 * math.exp(-0.3)) / 4, rel=1e-6)
    assert grad[0][1:] == pytest.approx([-1.1 / 4] * 3, rel=1e-6)
    assert figures(m)["tis/capped_frac"] == 0.75  # the 3 tokens of the capped sequence


def test_tis_off_is_the_plain_clipped_loss_bit_for_bit():
    # the loss before TIS existed: -min(r A, clip(r) A) with r = pi_train / pi_rollout, token-normalised
    loss, grad, m = _loss_and_grad(GrpoLoss())
    logp = (TRAINER * MASK).clone().requires_grad_(True)
    b = _batch()
    ratio = torch.exp((logp - b["old_logprobs"]) * MASK)
    adv = b["advantages"].unsqueeze(-1)
    ref = (-torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv) * MASK).sum() / MASK.sum()
    ref.backward()
    assert loss == float(ref.detach()) and grad == logp.grad.tolist()
    # by hand: seq 0 r = [0.904837, 1.221403 -> 1.2, 1]: -3.104837; seq 1 r = 0.740818 -> 0.8, A = -2: +1.6
    assert loss == pytest.approx((-(math.exp(-0.1) + 1.2 + 1.0) + 1.6) / 4, rel=1e-6)
    assert "tis_weight_sum" not in m and m["mismatch_tokens"] == 4


def test_config_keys_and_errors_name_the_key():
    cfg = load_config("configs/quickstart.yaml")
    assert cfg.algorithm.tis.enabled is False
    assert GrpoLoss.from_config(cfg.train, 1.0, cfg.algorithm).tis_cap is None
    on = load_config("configs/quickstart.yaml", ["algorithm.tis.enabled=true", "algorithm.tis.cap=3",
                                                  "algorithm.tis.level=sequence"])
    loss = GrpoLoss.from_config(on.train, 1.0, on.algorithm)
    assert (loss.tis_cap, loss.tis_level) == (3.0, "sequence")
    for override, says in [("algorithm.tis.cap=0", "greater than or equal to 1"),
                           ("algorithm.tis.cap=0.5", "greater than or equal to 1"),
                           ("algorithm.tis.cap=nan", "finite"), ("algorithm.tis.cap=true", "boolean"),
                           ("algorithm.tis.level=geometric", "'token' or 'sequence'")]:
        key = override.split("=")[0]
        with pytest.raises(ConfigError, match=rf"{key.replace('.', r'[.]')} = .*{says}"):
            load_config("configs/quickstart.yaml", [override])


def test_run_summary_weights_steps_by_tokens():
    steps = [{"mismatch_abs_mean": 0.1, "mismatch_abs_max": 0.5, "mismatch_k3": 0.01, "mismatch_tokens": 100,
              "mismatch_same_version_abs_mean": 0.1, "mismatch_same_version_abs_max": 0.5,
              "mismatch_same_version_k3": 0.01, "mismatch_same_version_tokens": 100},
             {"mismatch_abs_mean": 0.4, "mismatch_abs_max": 0.9, "mismatch_k3": 0.04, "mismatch_tokens": 300}, {}]
    r = run_mismatch(steps)
    assert r["mismatch_abs_mean"] == pytest.approx((0.1 * 100 + 0.4 * 300) / 400)
    assert r["mismatch_abs_max"] == 0.9 and r["mismatch_tokens"] == 400 and r["mismatch_steps"] == 2
    assert r["mismatch_k3"] == pytest.approx((0.01 * 100 + 0.04 * 300) / 400)
    assert r["mismatch_same_version_tokens"] == 100 and r["mismatch_same_version_steps"] == 1
    assert run_mismatch([{}, {}]) == {}


def test_analyze_shows_the_step_figures_and_the_run_summary(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", t0=0.0)
    e = log.emit_at
    e(0.0, "run_start", run_id="mm", source="runtime", world_size=2, wall_time=0.0)
    e(0.0, "topology", step=0, train_ranks="0", rollout_ranks="1")
    fig = [dict(mismatch_abs_mean=2.5e-7, mismatch_abs_max=1.9e-6, mismatch_k3=3.1e-14, mismatch_tokens=100,
                mismatch_same_version_abs_mean=2.5e-7, mismatch_same_version_abs_max=1.9e-6,
                mismatch_same_version_k3=3.1e-14, mismatch_same_version_tokens=100),
           dict(mismatch_abs_mean=0.02, mismatch_abs_max=0.3, mismatch_k3=4e-4, mismatch_tokens=300), {}]
    for k, f in enumerate(fig):
        e(2.0 * k, "step_start", step=k)
        e(2.0 * k + 1, "stage", step=k, stage="train", ranks="0", start=2.0 * k, end=2.0 * k + 1, tokens=10)
        e(2.0 * k + 2, "step_end", step=k, samples=4, **f)
    e(7.0, "run_end", status="completed", steps=3)
    log.close()
    s = analyze(load_run(tmp_path))
    rows = {r.step: r for r in s.steps}
    assert (rows[0].dlogp_mean, rows[0].dlogp_max, rows[0].mismatch_k3, rows[0].mismatch_tokens) == (2.5e-7, 1.9e-6, 3.1e-14, 100)
    assert rows[1].dlogp_max == 0.3 and rows[2].dlogp_mean is None  # a step without figures shows none, not 0
    m = s.totals["mismatch"]
    assert m["mismatch_abs_mean"] == pytest.approx((2.5e-7 * 100 + 0.02 * 300) / 400, rel=1e-5)
    assert m["mismatch_abs_max"] == 0.3 and m["mismatch_tokens"] == 400
    assert m["mismatch_same_version_abs_mean"] == 2.5e-7 and m["mismatch_same_version_steps"] == 1
    text = render(s)
    assert "dlogp_mean" in text and "2.5e-07" in text and "1.9e-06" in text  # tiny values are not printed as 0.00
    assert "|dlogp| mean / max, k3 (all trained tokens)" in text and "(same-version samples)" in text
    write_files(s, tmp_path / "out")
    header = (tmp_path / "out" / "steps.csv").read_text().splitlines()[0].split(",")
    assert {"dlogp_mean", "dlogp_max", "mismatch_k3", "mismatch_tokens"} <= set(header)
