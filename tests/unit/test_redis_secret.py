"""The external Redis's password: redacted from every dump of the config and every message, kept only in
owner-only files, and a password file that others can read refused with one clear error (issue 47, item 2)."""

from __future__ import annotations

import os

import pytest
import yaml

from dynaresize.config.loader import ConfigError, dump_config, load_config, write_resolved
from dynaresize.control.config import RedisConfig
from dynaresize.control.secret import SecretError, external_password, read_password_file, redact
from dynaresize.control.server import RedisServer, RedisServerError
from dynaresize.rundir import create_run_dir

pytestmark = pytest.mark.unit

PW = "s3cr3t-Pa55"
URL = f"redis://:{PW}@10.0.0.7:6390/2"


@pytest.mark.parametrize("text, want", [
    (URL, "redis://:***@10.0.0.7:6390/2"),
    (f"cannot reach redis://user:{PW}@h:1 (timeout)", "cannot reach redis://user:***@h:1 (timeout)"),
    (f"url='rediss://:{PW}@h'", "url='rediss://:***@h'"),
    ("redis://:p@ss@h:1/0", "redis://:***@h:1/0"),  # a raw '@' in the password: no tail left
    ("redis://h:6379/0 and no password", "redis://h:6379/0 and no password"),
])
def test_redact_replaces_every_urls_password(text, want):
    assert redact(text) == want


def test_config_dumps_and_config_yaml_hold_the_url_redacted_and_the_run_keeps_a_0600_copy(tmp_path):
    cfg = load_config(None, [f"redis.url={URL}"])
    assert cfg.redis.url == URL  # in memory: the real one (the server adopts it)
    assert PW not in dump_config(cfg) and PW not in str(cfg.model_dump(mode="json"))
    run_dir = create_run_dir(tmp_path, "r")
    write_resolved(cfg, run_dir)
    text = (run_dir / "config.yaml").read_text()
    assert PW not in text and yaml.safe_load(text)["redis"]["url"] == "redis://:***@10.0.0.7:6390/2"
    own = run_dir / "redis" / "password"
    assert own.read_text().strip() == PW
    assert own.stat().st_mode & 0o777 == 0o600 and (run_dir / "redis").stat().st_mode & 0o777 == 0o700
    assert run_dir.stat().st_mode & 0o777 == 0o700  # the run directory: its owner only
    # the redacted URL, loaded back (a resume): the password comes from the run's own copy
    again = load_config(run_dir / "config.yaml")
    assert external_password(again.redis.url, None, run_dir) == PW


def test_a_redacted_url_without_the_runs_copy_names_what_to_do(tmp_path):
    with pytest.raises(SecretError, match=r"redacted and .* does not exist; give it with redis.password_file"):
        external_password("redis://:***@h:1/0", None, tmp_path)


def test_a_password_file_readable_by_others_is_refused_with_its_mode(tmp_path):
    f = tmp_path / "pw"
    f.write_text(PW + "\n")
    f.chmod(0o644)
    with pytest.raises(SecretError, match=r"redis.password_file=.*mode 0644 lets other users read .*chmod 600"):
        read_password_file(f)
    f.chmod(0o400)
    assert read_password_file(f) == PW


def test_password_file_rules_are_config_errors_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="redis.password_file.*set redis.url too"):
        load_config(None, [f"redis.password_file={tmp_path / 'pw'}"])
    with pytest.raises(ConfigError, match="give it once") as e:
        load_config(None, [f"redis.url={URL}", f"redis.password_file={tmp_path / 'pw'}"])
    assert PW not in str(e.value)  # a config error is printed: the URL in it redacted


def test_an_external_server_with_a_password_file_is_adopted_without_copying_it(tmp_path):
    f = tmp_path / "pw"
    f.write_text(PW + "\n")
    f.chmod(0o600)
    run_dir = create_run_dir(tmp_path / "runs", "r")
    cfg = RedisConfig(url="redis://10.0.0.7:6390/0", password_file=str(f))
    ep = RedisServer(cfg, run_dir).start()  # adopting an external URL only writes the endpoint file
    assert ep.password() == PW and ep.password_file == str(f.resolve())
    assert not any(PW in p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file())
    f.chmod(0o640)
    with pytest.raises(RedisServerError, match="mode 0640"):
        RedisServer(cfg, create_run_dir(tmp_path / "runs", "r")).start()


def test_the_sbatch_script_and_the_submitted_run_directory_hold_no_password(tmp_path):
    from dynaresize.slurm.jobdir import new_run_dir
    from dynaresize.slurm.sbatch import render_sbatch
    from dynaresize.slurm.spec import build_spec

    cfg = load_config("configs/quickstart.yaml", [f"redis.url={URL}", f"run.output_dir={tmp_path}"])
    run_dir = new_run_dir(cfg)  # what `dynaresize submit` writes before sbatch
    assert PW not in render_sbatch(build_spec(cfg, str(run_dir), python="/usr/bin/python3"))
    holders = [p.name for p in run_dir.rglob("*") if p.is_file() and PW in p.read_text(errors="replace")]
    assert holders == ["password"] and (run_dir / "redis" / "password").stat().st_mode & 0o777 == 0o600
