"""A real job on an external Redis with a password (issue 47, item 2): a redis-server started here with
``requirepass``, the job given ``redis.url=redis://:PASSWORD@host:port/0``. No file the run wrote holds the password
except the run's own 0600 copy (``redis/password``, in its 0700 ``redis/``); ``config.yaml`` shows it redacted; a
resume of the run, which reads only that ``config.yaml``, still connects and trains on."""

from __future__ import annotations

import os
import secrets
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml

from dynaresize.net import free_port
from test_job import SEED, batches, run, wait_for_batches  # noqa: E402 - tests/integration is on sys.path (rootdir-less)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture
def passworded_redis(redis_binary, tmp_path):
    pw = "pw-" + secrets.token_hex(12)
    port = free_port()
    d = tmp_path / "external-redis"
    d.mkdir()
    conf = d / "redis.conf"
    conf.write_text(f'port {port}\nbind 127.0.0.1\nrequirepass "{pw}"\nsave ""\nappendonly no\ndir "{d}"\n')
    conf.chmod(0o600)
    p = subprocess.Popen([redis_binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    c = redis.Redis(port=port, password=pw)
    deadline = time.monotonic() + 20
    while True:
        try:
            c.ping()
            break
        except redis.RedisError:
            assert time.monotonic() < deadline and p.poll() is None, "the test's redis-server did not start"
            time.sleep(0.05)
    yield pw, f"redis://:{pw}@127.0.0.1:{port}/0"
    p.terminate()
    p.wait(timeout=10)


def test_no_file_of_a_run_holds_the_external_redis_password_and_a_resume_connects(tmp_path, model_cache,
                                                                                   passworded_redis):
    pw, url = passworded_redis
    runs, steps = tmp_path / "runs", 5
    p = run(runs, model_cache, f"run.steps={steps}", f"run.seed={SEED}", "policy.enabled=false", f"redis.url={url}",
            wait=False)
    rd = wait_for_batches(runs, p)
    os.killpg(p.pid, signal.SIGTERM)  # an operator's stop: checkpoint, then exit
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 130, out[-4000:]
    assert pw not in out, "the coordinator printed the password"
    out = run(runs, model_cache, resume=rd)  # config.yaml's URL is redacted: the run's own copy is used
    assert pw not in out
    assert [b["step"] for b in batches(rd)] == list(range(steps))

    own = rd / "redis" / "password"
    holders = [str(p.relative_to(rd)) for p in rd.rglob("*")
               if p.is_file() and p != own and pw.encode() in p.read_bytes()]
    assert holders == [], f"files holding the password: {holders}"
    assert own.read_text().strip() == pw and stat.S_IMODE(own.stat().st_mode) == 0o600
    assert stat.S_IMODE((rd / "redis").stat().st_mode) == 0o700 and stat.S_IMODE(rd.stat().st_mode) == 0o700
    cfg = yaml.safe_load((rd / "config.yaml").read_text())
    assert cfg["redis"]["url"] == url.replace(pw, "***")
