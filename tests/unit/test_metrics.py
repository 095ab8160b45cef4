"""The metrics loggers: JSONL always; TensorBoard event files read back with TensorBoard's own reader; W&B offline
files; a clear message (and exit 2, nothing created) when a logger is asked for but its package is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynaresize.config.loader import load_config
from dynaresize.contract.batch import TrainBatch
from dynaresize.job.runtime import StepTimes
from dynaresize.job.state import JobState
from dynaresize.metrics import (
    METRICS_FILE, MissingLoggerError, check_available, open_loggers, response_metrics, step_metrics, trainer_metrics,
)

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_the_logged_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = load_config(None, ["metrics.tensorboard=true"]).metrics
    loggers = open_loggers(cfg, tmp_path)
    loggers.log(0, {"reward/mean": 0.25, "loss/kl": 0.004837, "roles/n_train": 2.0, "skipped": float("nan")})
    loggers.log(1, {"reward/mean": 0.5, "loss/kl": 0.01, "roles/n_train": 3.0, "label": "not a number"})
    loggers.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    got = read_scalars(tmp_path / "tensorboard")
    assert set(got) == {"reward/mean", "loss/kl", "roles/n_train"}  # NaN and strings are not scalars
    assert got["reward/mean"] == [(0, 0.25), (1, 0.5)]
    assert got["roles/n_train"] == [(0, 2.0), (1, 3.0)]
    assert [s for s, _ in got["loss/kl"]] == [0, 1] and got["loss/kl"][0][1] == pytest.approx(0.004837)
    lines = [json.loads(l) for l in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert lines == [{"step": 0, "metrics": {"reward/mean": 0.25, "loss/kl": 0.004837, "roles/n_train": 2.0}},
                     {"step": 1, "metrics": {"reward/mean": 0.5, "loss/kl": 0.01, "roles/n_train": 3.0}}]


def test_only_jsonl_unless_asked(tmp_path):
    loggers = open_loggers(load_config(None, []).metrics, tmp_path)
    loggers.log(3, {"reward/mean": 1.0})
    loggers.close()
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "wandb").exists()
    assert json.loads((tmp_path / METRICS_FILE).read_text()) == {"step": 3, "metrics": {"reward/mean": 1.0}}


def test_wandb_writes_an_offline_run_and_never_the_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "online")  # the user's environment says online: offline wins anyway
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = load_config(None, ["metrics.wandb.enabled=true", "metrics.wandb.project=unit"]).metrics
    loggers = open_loggers(cfg, tmp_path, config={"run": {"seed": 3}})
    assert os.environ["WANDB_MODE"] == "offline"
    loggers.log(0, {"reward/mean": 0.25})
    loggers.log(1, {"reward/mean": 0.75, "loss/loss": -0.1})
    loggers.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (records,) = runs[0].glob("run-*.wandb")  # W&B's record log (protobuf): keys and JSON values are plain bytes
    data = records.read_bytes()
    assert data.startswith(b":W&B")
    for needle in (b"reward/mean", b"0.25", b"0.75", b"loss/loss", b"-0.1", b"unit"):
        assert needle in data, needle


BLOCK = "import sys; [sys.modules.__setitem__(m, None) for m in ('tensorboard', 'tensorboardX', 'torch.utils.tensorboard', 'wandb')]; "


@pytest.mark.parametrize("override,says", [
    ("metrics.tensorboard=true", "metrics.tensorboard is true but neither the 'tensorboard' nor the 'tensorboardX' package"),
    ("metrics.wandb.enabled=true", "metrics.wandb.enabled is true but the 'wandb' package is not installed"),
])
def test_a_missing_logger_package_is_one_message_and_creates_nothing(tmp_path, override, says):
    code = BLOCK + ("from dynaresize.cli import main; sys.exit(main(['run', 'configs/quickstart.yaml', "
                    f"'run.output_dir={tmp_path}/runs', '{override}', '--quiet']))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert says in p.stderr and "pip install 'dynaresize[" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "runs").exists()


def test_check_available_names_the_key(monkeypatch):
    for m in ("tensorboard", "tensorboardX", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, m, None)
    with pytest.raises(MissingLoggerError, match="metrics.tensorboard=false"):
        check_available(load_config(None, ["metrics.tensorboard=true"]).metrics)
    check_available(load_config(None, []).metrics)  # nothing asked for: nothing needed


def test_trainer_metrics_weight_by_tokens():
    acks = [{"loss": 0.5, "metrics": {"kl": 0.1, "clip_frac": 0.0, "ratio_mean": 1.0, "tokens": 30, "grad_norm": 2.0}},
            {"loss": -0.2, "metrics": {"kl": 0.2, "clip_frac": 0.5, "ratio_mean": 1.1, "tokens": 10, "grad_norm": 2.0}}]
    m = trainer_metrics(acks)
    assert m["loss/loss"] == pytest.approx(0.3)
    assert m["loss/kl"] == pytest.approx((0.1 * 30 + 0.2 * 10) / 40)
    assert m["loss/clip_frac"] == pytest.approx(0.125) and m["loss/grad_norm"] == 2.0


def test_step_metrics_cover_reward_lengths_throughput_roles_switches():
    batch = TrainBatch(step=4, prompt_ids=[[1], [1], [1]], response_ids=[[5, 0], [5, 5, 5, 5], [0]], logprobs=[[0, 0], [0] * 4, [0]],
                       advantages=[0, 0, 0], rewards=[1.0, 0.0, 0.5], versions=[4, 4, 4], keys=["4.0.0", "4.0.1", "4.0.2"])
    state = JobState(step=5, version=5, n_train=2, samples=30, tokens=90, loop_s=10.0, switches=[{"switch_id": "sw0"}], lost=[3])
    last = StepTimes(rollout_s=1.0, train_s=2.0, sync_s=1.0, tokens_generated=7)
    m = step_metrics(batch, [], last, state, n_rollout=1, max_tokens=4, eos_id=0,
                     stats={"score_mean": 0.6, "overlong_penalty_mean": -0.1, "groups_dropped": 2})
    assert m["reward/mean"] == pytest.approx(0.5) and m["reward/score_mean"] == 0.6
    assert m["response/length_mean"] == pytest.approx(7 / 3) and m["response/length_max"] == 4
    assert m["response/truncated_frac"] == pytest.approx(1 / 3)  # 4 tokens, no EOS
    assert m["throughput/tokens_per_s"] == 9.0 and m["throughput/step_tokens_per_s"] == pytest.approx(7 / 4)
    assert m["roles/n_train"] == 2 and m["roles/n_rollout"] == 1 and m["roles/n_lost"] == 1 and m["switches/count"] == 1
    assert m["dynamic_sampling/groups_dropped"] == 2 and "dynamic_sampling/groups_kept" not in m
    assert response_metrics([], 4, 0) == {}


def test_validation_passes_reach_every_logger_against_their_version(tmp_path):
    """A validation pass ends while a later step trains: its scalars go to metrics.jsonl (a line marked
    ``validation``), TensorBoard (at step = its version) and W&B (x-axis ``val/version``, logged at the newest
    training step: W&B drops an older one)."""
    pytest.importorskip("tensorboard")
    wandb = pytest.importorskip("wandb")
    cfg = load_config(None, ["metrics.tensorboard=true", "metrics.wandb.enabled=true", "metrics.wandb.project=unit"]).metrics
    loggers = open_loggers(cfg, tmp_path)
    loggers.log(0, {"reward/mean": 0.25})
    loggers.log(1, {"reward/mean": 0.5})
    loggers.log_validation(1, {"val/reward_mean": 0.078, "val/pass_at_k": 0.25, "val/reward_errors": 0})
    loggers.log(2, {"reward/mean": 0.75})
    assert [type(b).__name__ for b in loggers.backends] == ["JsonlLogger", "TensorBoardLogger", "WandbLogger"]  # none failed
    loggers.close()
    lines = [json.loads(l) for l in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert lines[2] == {"step": 1, "validation": True,
                        "metrics": {"val/reward_mean": 0.078, "val/pass_at_k": 0.25, "val/reward_errors": 0.0}}
    assert [l["step"] for l in lines if "validation" not in l] == [0, 1, 2]
    got = read_scalars(tmp_path / "tensorboard")
    assert got["val/reward_mean"] == [(1, pytest.approx(0.078))] and got["val/pass_at_k"] == [(1, 0.25)]
    (records,) = next((tmp_path / "wandb").glob("offline-run-*")).glob("run-*.wandb")
    data = records.read_bytes()
    for needle in (b"val/reward_mean", b"0.078", b"val/version", b"0.75"):  # the step after it was kept too
        assert needle in data, needle
