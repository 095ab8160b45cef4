"""Golden-file tests of the het-job sbatch text (submitit's own pattern), config checks, and the GPU configs.

Regenerate the golden files after an intended change: ``DYNARESIZE_UPDATE_GOLDEN=1 pytest tests/unit/test_slurm_sbatch.py``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dynaresize.config.loader import ConfigError, load_config
from dynaresize.slurm.sbatch import BODY_BEGIN, BODY_END, HETJOB_SEPARATOR, LAUNCH_BODY, render_sbatch
from dynaresize.slurm.spec import Component, build_spec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
RUN_DIR = "/shared/runs/RUN"  # normalised run directory
PYTHON = "/opt/venv/bin/python"  # normalised interpreter
CONFIGS = ["slurm-local", "gpu-8x1", "gpu-32x4"]


def _render(name: str, overrides: tuple[str, ...] = ()) -> str:
    cfg = load_config(ROOT / "configs" / f"{name}.yaml", list(overrides))
    return render_sbatch(build_spec(cfg, RUN_DIR, python=PYTHON))


@pytest.mark.parametrize("name", CONFIGS)
def test_sbatch_text_matches_golden(name: str) -> None:
    text = _render(name)
    golden = GOLDEN / f"sbatch-{name}.sh"
    if os.environ.get("DYNARESIZE_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"{golden} missing: run with DYNARESIZE_UPDATE_GOLDEN=1 to create it"
    assert text == golden.read_text(), f"sbatch text of configs/{name}.yaml changed; if intended, regenerate with DYNARESIZE_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("name", CONFIGS)
def test_two_components_separated_by_hetjob(name: str) -> None:
    text = _render(name)
    head, tail = text.split(HETJOB_SEPARATOR)
    assert text.count(HETJOB_SEPARATOR) == 1
    assert "--ntasks-per-node=1" in head and "--nodes=1" in head  # the coordinator: one node, one task
    assert "srun --het-group=0" in text and "srun --het-group=1" in text
    assert "#SBATCH --requeue" in head and "--signal=B:USR2@" in head
    assert text.endswith(LAUNCH_BODY)


def test_gpu_configs_validate_and_request_gpus() -> None:
    for name, gpus, nodes in (("gpu-8x1", 8, 1), ("gpu-32x4", 32, 4)):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        assert cfg.cluster.device == "cuda" and cfg.rollout.engine == "vllm" and cfg.model.path
        assert cfg.cluster.gpus == gpus and cfg.slurm.nodes == nodes
        spec = build_spec(cfg, RUN_DIR, python=PYTHON)
        workers = spec.components[Component.WORKERS]
        assert workers.ntasks == gpus and workers.gpus_per_node == cfg.slurm.gpus_per_node and workers.gpus_per_task == 1
        assert spec.total_tasks == gpus + 1
        tail = render_sbatch(spec).split(HETJOB_SEPARATOR)[1]
        assert f"--gpus-per-node={cfg.slurm.gpus_per_node}" in tail and f"--partition={cfg.slurm.gpu_partition}" in tail


def test_sbatch_options_from_config() -> None:
    text = _render("slurm-local", ("slurm.account=acct1", "slurm.qos=high", "slurm.time=02:00:00",
                                   "slurm.extra_sbatch=['--mail-type=END']", "slurm.gres_gpus=false",
                                   "slurm.setup=['module load cuda']", "slurm.requeue=false", "slurm.signal_before_s=0"))
    head, tail = text.split(HETJOB_SEPARATOR)
    for part in (head, tail):
        assert "#SBATCH --account=acct1" in part and "#SBATCH --qos=high" in part
        assert "#SBATCH --time=02:00:00" in part and "#SBATCH --mail-type=END" in part
    assert "--gpus-per-node" not in text and "#SBATCH --no-requeue" in head and "--signal" not in head
    assert "module load cuda" in text


def test_mismatched_rank_count_is_a_clear_error() -> None:
    cfg = load_config(ROOT / "configs" / "slurm-local.yaml", ["cluster.gpus=6", "cluster.gpus_per_node=2"])
    with pytest.raises(ConfigError, match=r"cluster.gpus = 6 .* 2 x 2 = 4"):
        build_spec(cfg, RUN_DIR)
    cfg = load_config(ROOT / "configs" / "slurm-local.yaml", ["slurm.extra_sbatch=['mail-type=END']"])
    with pytest.raises(ConfigError, match=r"slurm.extra_sbatch\[0\]"):
        build_spec(cfg, RUN_DIR)


def test_static_sbatch_script_launches_like_submit() -> None:
    static = (ROOT / "slurm" / "dynaresize.sbatch").read_text()
    assert LAUNCH_BODY in static, "slurm/dynaresize.sbatch must contain sbatch.LAUNCH_BODY verbatim (regenerate its body)"
    assert static.index(BODY_BEGIN) > static.index(HETJOB_SEPARATOR) and static.rstrip().endswith(BODY_END)
    assert os.access(ROOT / "slurm" / "dynaresize.sbatch", os.X_OK)


# --- the Python environment check of the launch body, run by bash with a stand-in srun -------------------------
# No Slurm here: `srun` is a script that drops its options and runs the command on this machine (the entry's tasks
# only log that they were started). What is tested is the generated shell, not Slurm.
FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> "$SRUN_LOG"
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
case "$*" in *dynaresize.slurm.entry*) exit 0;; esac
exec "$@"
"""


def _run_script(tmp_path: Path, text: str, *args: str, env: dict | None = None):
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(text)
    log = tmp_path / "srun.log"
    e = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SRUN_LOG=str(log), SLURM_JOB_ID="77",
             PYTHONPATH=str(ROOT), **(env or {}))
    r = subprocess.run(["bash", str(script), *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    return r, (log.read_text().splitlines() if log.exists() else [])


def _render_for(tmp_path: Path, python: str) -> str:
    cfg = load_config(ROOT / "configs" / "slurm-local.yaml")
    return render_sbatch(build_spec(cfg, tmp_path / "run", python=python))


def test_a_node_without_the_project_stops_the_job_before_any_rank_with_the_fix_in_the_main_output(tmp_path):
    import shlex
    import sys

    bad = f"{shlex.quote(sys.executable)} -I -S"  # no site-packages, no PYTHONPATH: the project is not importable
    r, calls = _run_script(tmp_path, _render_for(tmp_path, bad))
    assert r.returncode == 2, r.stdout + r.stderr
    out = r.stdout  # the batch script's stdout is the job's main output (#SBATCH --output)
    assert "dynaresize: component 0: ModuleNotFoundError: No module named 'dynaresize'" in out
    assert "the Python environment on the nodes of component 0 cannot run the job" in out
    assert "slurm.python=" in out and "DYNARESIZE_PYTHON=" in out and "No rank was started" in out
    assert len(calls) == 1 and "--het-group=0" in calls[0] and "dynaresize.slurm.entry" not in "".join(calls)


def test_with_a_working_python_the_check_passes_on_both_components_then_the_ranks_start(tmp_path):
    import shlex
    import sys

    r, calls = _run_script(tmp_path, _render_for(tmp_path, shlex.quote(sys.executable)), env={"GRACE_S": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cannot run the job" not in r.stdout and "dynaresize: coordinator exit code 0" in r.stdout
    checks = [c for c in calls if "import dynaresize, torch" in c]
    assert [("--het-group=0" in c, "--het-group=1" in c) for c in checks] == [(True, False), (False, True)]
    assert calls.index(checks[-1]) < min(i for i, c in enumerate(calls) if "dynaresize.slurm.entry" in c)


def test_the_hand_written_script_checks_the_batch_hosts_python_first(tmp_path):
    import sys

    r, calls = _run_script(tmp_path, (ROOT / "slurm" / "dynaresize.sbatch").read_text(), "configs/slurm-local.yaml",
                           env={"DYNARESIZE_PYTHON": f"{sys.executable} -I -S"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "dynaresize: batch host: ModuleNotFoundError: No module named 'dynaresize'" in r.stdout
    assert "Fix: export DYNARESIZE_PYTHON=" in r.stdout and calls == []


def _usr2_lines() -> str:
    """The batch shell's USR2 hand-over lines of the launch body (from the file names to the trap)."""
    lines = LAUNCH_BODY.splitlines()
    a = next(i for i, l in enumerate(lines) if l.startswith("USR2_SEEN="))
    b = next(i for i, l in enumerate(lines) if l.startswith("trap ") and "USR2" in l)
    return "\n".join(lines[a:b + 1])


def test_a_warning_before_the_coordinator_listens_is_recorded_and_later_ones_forwarded(tmp_path) -> None:
    # Real bash: USR2 while no coordinator runs (the environment check) must not end the shell (bash's default for
    # USR2 without a trap): it is recorded; once the coordinator listens, the next one is forwarded to it.
    script = f"""set -u
LOG_DIR={tmp_path}; TAG=7.r0
{_usr2_lines()}
kill -USR2 $$; sleep 0.2
[ -e "$USR2_SEEN" ] && echo recorded
bash -c 'trap "echo got > {tmp_path}/coord-got; exit 0" USR2; while :; do sleep 0.05; done' &
COORD=$!
kill -USR2 $$; sleep 0.3
[ -e {tmp_path}/coord-got ] && echo early-forwarded
: > "$COORD_LISTENS"
kill -USR2 $$
for _ in $(seq 1 50); do [ -e {tmp_path}/coord-got ] && break; sleep 0.05; done
[ -e {tmp_path}/coord-got ] && echo forwarded
wait $COORD
echo alive
"""
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, (p.stdout, p.stderr)
    out = p.stdout.splitlines()
    assert "recorded" in out and "forwarded" in out and out[-1] == "alive"
    assert "early-forwarded" not in out  # not sent before the coordinator says it listens (USR2 would kill it)
    assert out.count("dynaresize: USR2 received, forwarded to the coordinator") == 3


def test_the_coordinator_takes_a_warning_recorded_before_it_listened(tmp_path) -> None:
    from dynaresize.slurm.entry import take_early_warning
    from dynaresize.slurm.preempt import Preemption

    env = {"DYNARESIZE_USR2_SEEN": str(tmp_path / "seen"), "DYNARESIZE_COORDINATOR_LISTENS": str(tmp_path / "listens")}
    quiet = Preemption("1", 0, True, 1)
    assert take_early_warning(quiet, env) is False and not quiet.requested
    assert (tmp_path / "listens").exists()  # from now on the shell forwards the signal itself
    (tmp_path / "seen").touch()
    warned = Preemption("1", 0, True, 1)
    assert take_early_warning(warned, env) is True and warned.requested
    assert take_early_warning(Preemption("1", 0, True, 1), {}) is False  # outside a batch script: nothing to take
