"""The config loader: layering, overrides, and one clear error per mistake (file, key path, value, allowed)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from dynaresize.config.loader import ConfigError, dump_config, iter_fields, load_config, parse_override, write_resolved

pytestmark = pytest.mark.unit
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def write(p: Path, data) -> Path:
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return p


def test_every_field_has_a_description():
    missing = [path for path, _, _, desc in iter_fields() if not desc or not desc.strip()]
    assert missing == []


def test_extends_and_overrides_layer_in_order(tmp_path):
    write(tmp_path / "base.yaml", {"train": {"lr": 0.5, "zero_stage": 2}, "run": {"steps": 7}})
    cfg_file = write(tmp_path / "exp.yaml", {"extends": "base.yaml", "train": {"lr": 0.25}})
    cfg = load_config(cfg_file, ["run.steps=9", "cluster.gpus=8", "train.kl_coef=1e-3"])
    assert cfg.train.lr == 0.25  # file beats base
    assert cfg.train.zero_stage == 2  # base kept where the file is silent
    assert cfg.run.steps == 9 and cfg.cluster.gpus == 8  # overrides beat both
    assert cfg.train.kl_coef == pytest.approx(1e-3)  # '1e-3' is a number, not a string


def test_unknown_key_names_file_key_and_allowed(tmp_path):
    f = write(tmp_path / "bad.yaml", {"train": {"learning_rate": 1e-5}})
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert "bad.yaml" in msg and "train.learning_rate" in msg and "unknown key" in msg
    assert "lr" in msg  # the allowed keys are listed


def test_invalid_value_names_source_key_value_and_rule(tmp_path):
    f = write(tmp_path / "bad.yaml", {"train": {"lr": -1}})
    with pytest.raises(ConfigError, match=r"bad\.yaml: train\.lr = -1: .*greater than 0"):
        load_config(f)


def test_bad_override_is_attributed_to_the_override(tmp_path):
    f = write(tmp_path / "ok.yaml", {"run": {"steps": 3}})
    with pytest.raises(ConfigError, match=r"override 'cluster\.gpus=lots': cluster\.gpus = 'lots'"):
        load_config(f, ["cluster.gpus=lots"])
    with pytest.raises(ConfigError, match="override 'nope.x=1': nope: unknown key"):
        load_config(f, ["nope.x=1"])
    with pytest.raises(ConfigError, match="expected key.path=value"):
        parse_override("train.lr")


def test_value_from_base_file_is_attributed_to_the_base(tmp_path):
    write(tmp_path / "base.yaml", {"rollout": {"temperature": 0}})
    f = write(tmp_path / "exp.yaml", {"extends": "base.yaml"})
    with pytest.raises(ConfigError, match=r"base\.yaml: rollout\.temperature = 0"):
        load_config(f)


def test_cross_field_rules(tmp_path):
    with pytest.raises(ConfigError, match="initial_train=4 leaves no rollout rank"):
        load_config(None, ["cluster.gpus=4", "cluster.initial_train=4"])
    with pytest.raises(ConfigError, match="require_password must be true"):
        load_config(None, ["redis.bind=0.0.0.0", "redis.require_password=false"])


def test_extends_cycle_and_missing_base_are_reported(tmp_path):
    write(tmp_path / "a.yaml", {"extends": "b.yaml"})
    write(tmp_path / "b.yaml", {"extends": "a.yaml"})
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    write(tmp_path / "c.yaml", {"extends": "missing.yaml"})
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "c.yaml")


def test_not_yaml_and_not_mapping(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path / "x.yaml", "train: [1, 2\n"))
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(write(tmp_path / "y.yaml", "- 1\n- 2\n"))


def test_every_yaml_file_a_user_gives_fails_the_same_way(tmp_path, capsys):
    """An experiment config, a verl config (config from-verl) and a cost file (simulate --costs) share one reader:
    each mistake is one message naming the file, with YAML's line and column."""
    from dynaresize.cli import main as cli
    from dynaresize.config.schema import Config
    from dynaresize.sim.cli import merge_costs

    def message(path: Path) -> list[str]:
        out = []
        for read in (load_config, lambda p: merge_costs(Config(), str(p))):
            with pytest.raises(ConfigError) as e:
                read(path)
            out.append(str(e.value))
        assert cli(["config", "from-verl", str(path)]) == 2
        out.append(capsys.readouterr().err)
        return out

    for m in message(write(tmp_path / "x.yaml", "train: [1, 2\n")):
        assert "x.yaml: not valid YAML: while parsing a flow sequence" in m and "line 1, column 8" in m
    for m in message(write(tmp_path / "y.yaml", "- 1\n")):
        assert "y.yaml: the top level must be a mapping of " in m and m.rstrip().endswith("got list")
    for m in message(tmp_path / "missing.yaml"):
        assert "missing.yaml: cannot read " in m and "No such file or directory" in m


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "quickstart.yaml", ["train.lr=2e-4"])
    out = write_resolved(cfg, tmp_path)
    again = load_config(out)
    assert again == cfg
    assert dump_config(again) == out.read_text()


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_shipped_configs_validate(path):
    load_config(path)


def test_the_old_schedule_name_is_an_alias():
    assert load_config("configs/quickstart.yaml", ["pipeline.schedule=continuous"]).pipeline.schedule == "barrier_free"


def test_an_old_lockstep_config_runs_the_barrier_schedule_with_one_line_naming_it(caplog):
    """The hand-written lockstep loop is gone: ``lockstep`` is the same static one-step-off schedule on the core."""
    with caplog.at_level(logging.WARNING, logger="dynaresize.config"):
        cfg = load_config("configs/quickstart.yaml", ["pipeline.schedule=lockstep"])
    assert cfg.pipeline.schedule == "barrier"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0] and "pipeline.schedule: barrier" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dynaresize.config"):
        load_config("configs/quickstart.yaml", ["pipeline.schedule=barrier"])
    assert not caplog.records


def test_the_mixed_step_setting_is_read_and_ignored_with_one_line_saying_why(caplog):
    """Every run directory written before carries ``pipeline.mixed_switch``: it loads, and says why it is ignored."""
    with caplog.at_level(logging.WARNING, logger="dynaresize.config"):
        cfg = load_config("configs/quickstart.yaml", ["pipeline.mixed_switch=true"])
    assert not hasattr(cfg.pipeline, "mixed_switch") and "mixed_switch" not in cfg.pipeline.model_dump()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pipeline.mixed_switch is ignored" in lines[0] and "keep decoding" in lines[0], lines


def test_validation_and_dynamic_sampling_run_on_every_schedule():
    for sched in ("barrier_free", "barrier"):
        assert load_config("configs/quickstart.yaml", [f"pipeline.schedule={sched}", "task.dataset.val_every=2",
                                                       "algorithm.dynamic_sampling.enabled=true"])


def test_the_continuous_schedule_is_named_in_the_error_for_an_unknown_value():
    with pytest.raises(ConfigError, match=r"pipeline\.schedule = 'barrierless'"):
        load_config("configs/quickstart.yaml", ["pipeline.schedule=barrierless"])


def test_vllm_runs_on_either_schedule_but_not_on_the_emulated_accelerator():
    for schedule in ("barrier", "barrier_free"):
        cfg = load_config("configs/quickstart.yaml", [f"pipeline.schedule={schedule}", "task.dataset.val_every=0",
                                                       "rollout.engine=vllm"])
        assert (cfg.rollout.engine, cfg.pipeline.schedule) == ("vllm", schedule)
    with pytest.raises(ConfigError, match=r"rollout\.engine = 'vllm': the emulated accelerator paces the torch engine"):
        load_config("configs/emulated-8gpu.yaml", ["rollout.engine=vllm"])
