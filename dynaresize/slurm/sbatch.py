"""Render a :class:`~dynaresize.slurm.spec.HetJobSpec` as sbatch text (pure; golden-file tested).

Layout of the script::

    #SBATCH <job-wide options and component 0's resources>
    #SBATCH hetjob
    #SBATCH <component 1's resources>
    RUN_DIR=... PY=(...)                       # the only lines that differ from slurm/dynaresize.sbatch
    <LAUNCH_BODY>                              # the Python check on every task (`srun ... python -c 'import
                                               # dynaresize, torch'`: a failure and its fix go to the main
                                               # output, exit 2), one `srun --het-group=i` per component, USR2
                                               # forwarding, wait

:data:`LAUNCH_BODY` is shared verbatim with the hand-written ``slurm/dynaresize.sbatch`` (a unit test checks it),
so a user's ``sbatch slurm/dynaresize.sbatch CONFIG`` and ``dynaresize submit CONFIG`` launch the same way.

Signals: ``--signal=B:USR2@<s>`` delivers the time-out warning to the batch shell only (so worker ranks are never
hit by a signal they do not handle); the shell's trap forwards it to the coordinator's srun, and srun forwards
USR2 to its task (checked on Slurm 22.05).
"""

from __future__ import annotations

import shlex

from dynaresize.slurm.spec import COORDINATOR_LISTENS_ENV, USR2_SEEN_ENV, Component, HetComponent, HetJobSpec

HETJOB_SEPARATOR = "#SBATCH hetjob"
BODY_BEGIN = "# ---- launch: identical in `dynaresize submit` scripts and slurm/dynaresize.sbatch ----"
BODY_END = "# ---- end of launch ----"

PYTHON_CHECK_CODE = "import dynaresize, torch"
FIX_HINT = ("set slurm.python to a Python that has the project installed on every node (dynaresize submit CONFIG "
            "slurm.python=/path/to/venv/bin/python), or export DYNARESIZE_PYTHON=/path/to/venv/bin/python before "
            "sbatch slurm/dynaresize.sbatch; slurm.setup runs module loads or a venv activation first")
# a shell function (bash, in the batch script): run the import on every task of het component $1 (more srun
# options after it); on failure print the tasks' output and the fix to this script's stdout, return 2
PYTHON_CHECK = (
    'check_python() { local g=$1 out rc; shift\n'
    f'  out=$(DYNARESIZE_HET_GROUP=$g srun --het-group=$g --unbuffered --kill-on-bad-exit=0 "$@" "${{PY[@]}}" -c {shlex.quote(PYTHON_CHECK_CODE)} 2>&1); rc=$?\n'
    '  if [ "$rc" -eq 0 ]; then return 0; fi\n'
    '  printf \'%s\\n\' "$out" | tail -n 20 | sed "s/^/dynaresize: component $g: /"\n'
    f'  echo "dynaresize: the Python environment on the nodes of component $g cannot run the job: ${{PY[*]}} -c {shlex.quote(PYTHON_CHECK_CODE)} failed (exit $rc; its output is above). No rank was started. Fix: {FIX_HINT}."\n'
    '  return 2; }'
)

LAUNCH_BODY = f"""{BODY_BEGIN}
LOG_DIR="$RUN_DIR/slurm"
mkdir -p "$LOG_DIR"
TAG="${{SLURM_JOB_ID}}.r${{SLURM_RESTART_COUNT:-0}}"
WORKER_SRUN=()
if [ -n "${{SLURM_GPUS_PER_NODE_HET_GROUP_1:-}}" ]; then WORKER_SRUN=(--gpus-per-task=1); fi  # one GPU per rank
echo "dynaresize: job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}} on $(hostname), run dir $RUN_DIR"
# Slurm's time-out/preemption warning (--signal=B:USR2@s) reaches this shell, possibly before the coordinator runs
# (USR2 without a trap would end this shell): it is recorded in a file and forwarded once the coordinator listens;
# the coordinator, once it listens, takes a warning recorded before (each side writes its file, then reads the other's).
USR2_SEEN="$LOG_DIR/$TAG.usr2-received"; COORD_LISTENS="$LOG_DIR/$TAG.coordinator-listens"; COORD=
trap 'echo "dynaresize: USR2 received, forwarded to the coordinator"; : > "$USR2_SEEN"; if [ -n "$COORD" ] && [ -e "$COORD_LISTENS" ]; then kill -USR2 "$COORD" 2>/dev/null; fi' USR2
# The Python environment on the nodes, before any rank starts: every task of both components imports the project
# and torch; a node that cannot shows its error and the fix here, in the job's main output, not in a rank's log.
{PYTHON_CHECK}
check_python 0 --ntasks=1 || exit 2
check_python 1 || exit 2
DYNARESIZE_HET_GROUP=0 {USR2_SEEN_ENV}="$USR2_SEEN" {COORDINATOR_LISTENS_ENV}="$COORD_LISTENS" \\
  srun --het-group=0 --ntasks=1 --unbuffered --output="$LOG_DIR/$TAG-coordinator.log" \\
  "${{PY[@]}}" -m dynaresize.slurm.entry coordinator --run-dir "$RUN_DIR" &
COORD=$!
# one dead rank must not take its step down (sites may set KillOnBadExit=1 or a WaitTime): the coordinator decides
DYNARESIZE_HET_GROUP=1 srun --het-group=1 --unbuffered --kill-on-bad-exit=0 --wait=0 "${{WORKER_SRUN[@]}}" \\
  --output="$LOG_DIR/$TAG-worker-%t.log" "${{PY[@]}}" -m dynaresize.slurm.entry worker --run-dir "$RUN_DIR" &
WORKERS=$!
wait_pid() {{ local rc; while :; do wait "$1"; rc=$?; if [ "$rc" -gt 128 ] && kill -0 "$1" 2>/dev/null; then continue; fi; return "$rc"; done; }}
wait_pid "$COORD"; RC=$?
for _ in $(seq 1 "${{GRACE_S:-60}}"); do kill -0 "$WORKERS" 2>/dev/null || break; sleep 1; done
if kill -0 "$WORKERS" 2>/dev/null; then echo "dynaresize: workers still running after the coordinator ended; stopping them"; kill -TERM "$WORKERS"; fi
wait_pid "$WORKERS"
echo "dynaresize: coordinator exit code $RC"
exit "$RC"
{BODY_END}
"""


def _flag(key: str, value: object) -> str:
    return f"#SBATCH --{key}={shlex.quote(str(value))}"


def _resources(c: HetComponent, spec: HetJobSpec) -> list[str]:
    lines = [f"# component {int(c.component)}: {c.role}" + (" + embedded Redis" if c.component == Component.COORDINATOR else f"s, one rank per GPU ({c.ntasks} ranks)")]
    if c.partition:
        lines.append(_flag("partition", c.partition))
    lines.append(_flag("time", spec.time))
    if spec.account:
        lines.append(_flag("account", spec.account))
    if spec.qos:
        lines.append(_flag("qos", spec.qos))
    lines.append(_flag("nodes", c.nodes))
    lines.append(_flag("ntasks-per-node", c.ntasks_per_node))
    lines.append(_flag("cpus-per-task", c.cpus_per_task))
    if c.gpus_per_node:
        lines.append(_flag("gpus-per-node", c.gpus_per_node))
    if c.mem:
        lines.append(_flag("mem", c.mem))
    if c.constraint:
        lines.append(_flag("constraint", c.constraint))
    lines += [f"#SBATCH {x}" for x in spec.extra_sbatch]
    return lines


def render_sbatch(spec: HetJobSpec) -> str:
    """The full sbatch text of ``spec`` (submit it with ``sbatch``; resubmitting it resumes the same run dir)."""
    log_dir = spec.log_dir
    head = [
        "#!/bin/bash",
        f"# Generated by `dynaresize submit` for the run directory {spec.run_dir}",
        "# Resubmitting this file (sbatch <file>) resumes that run directory from its last checkpoint.",
        _flag("job-name", spec.job_name),
        _flag("output", f"{log_dir}/%j_0_log.out"),
        _flag("error", f"{log_dir}/%j_0_log.err"),
        _flag("open-mode", "append"),
        "#SBATCH --requeue" if spec.requeue else "#SBATCH --no-requeue",
    ]
    if spec.signal_before_s > 0:
        head.append(_flag("signal", f"B:USR2@{spec.signal_before_s}"))
    lines = head
    for i, comp in enumerate(spec.components):
        if i:
            lines.append(HETJOB_SEPARATOR)
        lines += _resources(comp, spec)
    lines.append("")
    for k, v in spec.env:
        lines.append(f"export {k}={shlex.quote(v)}")
    if spec.setup:
        lines += ["# setup (slurm.setup)", *spec.setup]
    coord = spec.components[0].argv
    py = coord[: coord.index("-m")]
    lines += [
        f"RUN_DIR={shlex.quote(spec.run_dir)}",
        f"PY=({shlex.join(py)})",
        f"GRACE_S={spec.worker_exit_grace_s}",
        "",
    ]
    return "\n".join(lines) + "\n" + LAUNCH_BODY
