"""Bad configs (fault matrix row 9): wrong types, unknown keys at every depth and impossible topologies each give
exactly one error line naming the file (or the override), the key path and the value; ``dynaresize run`` with a
bad config prints that one line, exits 2 and creates nothing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dynaresize.config.loader import ConfigError, load_config, write_resolved

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

NODE4 = {"granularity": "node", "gpus": 8, "gpus_per_node": 4, "initial_train": 4}
# (id, file content, key path named, value shown, what the message says)
BAD = [
    # wrong types
    ("str-for-int", {"run": {"steps": "ten"}}, "run.steps", "'ten'", "valid integer"),
    ("list-for-int", {"run": {"steps": [1, 2]}}, "run.steps", "[1, 2]", "valid integer"),
    ("bool-for-int", {"run": {"checkpoint_every": True}}, "run.checkpoint_every", "True", "got the boolean"),
    ("yes-for-float", "train:\n  lr: yes\n", "train.lr", "True", "got the boolean"),
    ("str-for-float", {"train": {"lr": "fast"}}, "train.lr", "'fast'", "valid number"),
    ("fraction-for-int", {"redis": {"max_message_bytes": 1.5}}, "redis.max_message_bytes", "1.5", "fractional part"),
    ("str-for-bool", {"run": {"progress": "maybe"}}, "run.progress", "'maybe'", "valid boolean"),
    ("scalar-for-section", {"cluster": 4}, "cluster", "4", "valid dictionary"),
    ("str-for-mapping", {"policy": {"forced_splits": "x"}}, "policy.forced_splits", "'x'", "valid dictionary"),
    ("not-a-choice", {"cluster": {"device": "tpu"}}, "cluster.device", "'tpu'", "'cpu', 'cuda' or 'emulated'"),
    # unknown keys, depth 1 to 4
    ("unknown-section", {"trian": {"lr": 1}}, "trian", None, "unknown key; allowed here: run, cluster"),
    ("unknown-key-2", {"train": {"learning_rate": 1e-5}}, "train.learning_rate", "1e-05", "unknown key; allowed here: engine"),
    ("unknown-key-3", {"model": {"tiny": {"hidden": 64}}}, "model.tiny.hidden", "64", "unknown key; allowed here: hidden_size"),
    ("unknown-key-3b", {"sim": {"workload": {"drfit": "linear"}}}, "sim.workload.drfit", "'linear'", "allowed here: prompts_per_step"),
    ("unknown-op-4", {"switching": {"costs": {"override_s": {"teleport": 1.0}}}}, "switching.costs.override_s.teleport", "1.0",
     "unknown switch op 'teleport'"),
    # keys that moved: named with their new place
    ("moved-sim-costs", {"sim": {"costs": {"pcie_gbps": 9.0}}}, "sim.costs", "{...}", "sim.costs has moved to switching.costs"),
    ("moved-sim-optimizations", {"sim": {"optimizations": {"comm_reuse": False}}}, "sim.optimizations", "{...}",
     "sim.optimizations has moved to switching.optimizations"),
    ("moved-staging-deferred", {"staging": {"deferred_optimizer": False}}, "staging.deferred_optimizer", "False",
     "staging.deferred_optimizer has moved to switching.optimizations.deferred_optimizer"),
    # impossible topologies and bounds
    ("all-train", {"cluster": {"gpus": 4, "initial_train": 4}}, "cluster.initial_train", "4", "leaves no rollout rank"),
    ("more-train-than-gpus", {"cluster": {"gpus": 4, "initial_train": 7}}, "cluster.initial_train", "7", "allowed: 1..3"),
    ("one-gpu", {"cluster": {"gpus": 1, "initial_train": 1}}, "cluster.gpus", "1", "greater than or equal to 2"),
    ("gpus-not-whole-nodes", {"cluster": NODE4 | {"gpus": 6}}, "cluster.gpus", "6", "multiple of gpus_per_node (4)"),
    ("train-not-whole-nodes", {"cluster": NODE4 | {"initial_train": 2}}, "cluster.initial_train", "2", "multiple of gpus_per_node"),
    ("negative-staleness", {"pipeline": {"staleness_bound": -1}}, "pipeline.staleness_bound", "-1", "greater than or equal to 0"),
    ("forced-all-train", {"cluster": {"gpus": 4}, "policy": {"forced_splits": {3: 4}}}, "policy.forced_splits.3", "4",
     "not a valid forced split for cluster.gpus=4"),
    ("forced-zero", {"policy": {"forced_splits": {2: 0}}}, "policy.forced_splits.2", "0", "from 1 to 3"),
    ("forced-negative-step", {"policy": {"forced_splits": {-1: 2}}}, "policy.forced_splits.-1", "2", "at steps >= 0"),
    ("forced-not-a-node", {"cluster": NODE4, "policy": {"forced_splits": {2: 2}}}, "policy.forced_splits.2", "2",
     "multiples of 4 from 4 to 4"),
    ("open-redis", {"redis": {"bind": "0.0.0.0", "require_password": False}}, "redis.require_password", "False",
     "require_password must be true"),
    ("micro-below-a-sequence", {"rollout": {"max_tokens": 48}, "train": {"micro_batch_tokens": 40}},
     "train.micro_batch_tokens", "40", "rollout.max_tokens=48 response tokens after a prompt of at least 1 token need at least 49"),
    ("bf16-on-a-float32-model", {"model": {"dtype": "float32"}, "train": {"precision": "bf16"}}, "train.precision",
     "'bf16'", "model.dtype=float32 trains in fp32"),
    ("fp32-on-a-bfloat16-model", {"model": {"dtype": "bfloat16"}, "train": {"precision": "fp32"}}, "train.precision",
     "'fp32'", "set train.precision=bf16 or auto, or model.dtype=float32"),
    ("curriculum-inverted", {"task": {"curriculum": {"min_len": 5, "max_len_start": 3}}}, "task.curriculum.max_len_start",
     "3", "below min_len=5"),
]


def write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("content,key,value,says", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_each_bad_config_is_one_line_naming_file_key_and_value(tmp_path, content, key, value, says):
    f = write(tmp_path / "bad.yaml", content)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert "\n" not in msg, f"one problem, one line:\n{msg}"
    shown = "" if value is None else f" = {value}"
    assert msg.startswith(f"invalid config: {f}: {key}{shown}: "), msg
    assert says in msg


OVERRIDES = [
    ("cluster.initial_train=4", "cluster.initial_train = 4", "leaves no rollout rank"),
    ("cluster.gpus=lots", "cluster.gpus = 'lots'", "valid integer"),
    ("pipeline.staleness_bound=-2", "pipeline.staleness_bound = -2", "greater than or equal to 0"),
    ("policy.forced_splits={5: 4}", "policy.forced_splits.5 = 4", "not a valid forced split"),
    ("switching.costs.override_s={teleport: 2}", "switching.costs.override_s.teleport = 2.0", "unknown switch op"),
    ("sim.costs.pcie_gbps=9", "sim.costs = {...}", "sim.costs has moved to switching.costs"),
    ("staging.deferred_optimizer=false", "staging.deferred_optimizer = False", "has moved to switching.optimizations.deferred_optimizer"),
    ("train.zero_stage=on", "train.zero_stage = True", "got the boolean"),
    ("model.tiny.layers=3", "model.tiny.layers = 3", "unknown key"),
]


@pytest.mark.parametrize("override,named,says", OVERRIDES, ids=[o[0] for o in OVERRIDES])
def test_a_bad_override_is_blamed_on_the_override_not_the_file(override, named, says):
    # quickstart.yaml sets cluster.initial_train and switching.costs.override_s itself: the override must still be blamed
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "quickstart.yaml", [override])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"invalid config: override '{override}': {named}: "), msg
    assert says in msg


def test_each_mistake_in_one_file_is_its_own_line(tmp_path):
    f = write(tmp_path / "two.yaml", {"run": {"steps": 0}, "train": {"learning_rate": 1}})
    with pytest.raises(ConfigError) as e:
        load_config(f)
    head, *lines = str(e.value).splitlines()
    assert head == "invalid config (2 problems):"
    assert [l.split(": ")[1] for l in lines] == ["run.steps = 0", "train.learning_rate = 1"]


def test_a_huge_value_is_clipped_in_the_message(tmp_path):
    f = write(tmp_path / "big.yaml", {"run": {"name": "x" * 10_000 + " with spaces"}})
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert len(str(e.value)) < 400 and "run.name = 'xxx" in str(e.value)


def test_booleans_stay_booleans_and_numbers_numbers(tmp_path):
    cfg = load_config(write(tmp_path / "ok.yaml", "run:\n  progress: no\n  steps: 3\ntrain:\n  lr: 1.0e-4\n"))
    assert cfg.run.progress is False and cfg.run.steps == 3 and cfg.train.lr == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="got the boolean"):
        cfg.run.steps = True  # validated assignment too


# -- the command line ------------------------------------------------------------------------------------------
def _dynaresize(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "dynaresize.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _tree(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def test_run_with_a_bad_override_prints_one_line_exits_2_and_creates_nothing(tmp_path):
    out = tmp_path / "runs"
    r = _dynaresize("run", "configs/quickstart.yaml", f"run.output_dir={out}", "cluster.initial_train=4", "--quiet")
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr.splitlines() == [
        "dynaresize run: invalid config: override 'cluster.initial_train=4': cluster.initial_train = 4: "
        "initial_train=4 leaves no rollout rank out of gpus=4; allowed: 1..3"
    ]
    assert not out.exists(), "a rejected config must not create a run directory"


def test_resume_with_a_bad_override_leaves_the_run_untouched(tmp_path):
    from dynaresize.rundir import create_run_dir

    run_dir = create_run_dir(tmp_path, "run")
    write_resolved(load_config(ROOT / "configs" / "quickstart.yaml", [f"run.output_dir={tmp_path}"]), run_dir)
    before = _tree(run_dir)
    r = _dynaresize("run", "--resume", str(run_dir), "run.steps=many", "--quiet")
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.splitlines()
    assert line.startswith("dynaresize run: invalid config: override 'run.steps=many': run.steps = 'many': ")
    assert _tree(run_dir) == before and sorted(p.name for p in tmp_path.iterdir()) == [run_dir.name]


def test_resume_of_a_folder_holding_only_the_users_config_is_refused_and_writes_nothing(tmp_path):
    """`--resume` on a folder the project did not create (here: the user's own config, with an ``extends:`` line)
    names what is missing, exits 2 without a traceback, and leaves the folder byte-identical."""
    mine = tmp_path / "my-experiment"
    mine.mkdir()
    text = f"extends: {ROOT / 'configs' / 'quickstart.yaml'}\nrun:\n  steps: 3\n"
    (mine / "config.yaml").write_text(text)
    before = _tree(mine)
    r = _dynaresize("run", "--resume", str(mine), "--quiet")
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.splitlines()
    assert line.startswith(f"dynaresize run: --resume: {mine}: not a run directory created by dynaresize (no "
                           ".dynaresize-run.json marker"), line
    assert "nothing was written into it" in line and "Traceback" not in r.stderr
    assert _tree(mine) == before and sorted(p.name for p in mine.iterdir()) == ["config.yaml"]
    assert (mine / "config.yaml").read_text() == text  # the extends: line is still there


def test_resume_names_a_missing_directory_a_damaged_marker_and_a_missing_config(tmp_path):
    from dynaresize.rundir import MARKER, RunDirError, create_run_dir, require_run_dir

    with pytest.raises(RunDirError, match="no such directory"):
        require_run_dir(tmp_path / "nope")
    rd = create_run_dir(tmp_path, "x")
    assert json.loads((rd / MARKER).read_text())["run_id"] == rd.name
    with pytest.raises(RunDirError, match="without its resolved config.yaml"):
        require_run_dir(rd)
    (rd / "config.yaml").write_text("run: {}\n")
    assert require_run_dir(rd) == rd
    (rd / MARKER).write_text("{not json")
    with pytest.raises(RunDirError, match=f"{MARKER}: unreadable run marker"):
        require_run_dir(rd)


def test_a_run_directory_from_before_the_marker_is_still_resumable(tmp_path):
    """Recognised by its event log's first record: the run_start of a run named like the directory."""
    from dynaresize.rundir import RunDirError, require_run_dir

    rd = tmp_path / "old-20261130-010203"
    rd.mkdir()
    (rd / "config.yaml").write_text("run: {}\n")
    (rd / "events.jsonl").write_text(json.dumps({"v": 1, "type": "run_start", "run_id": "other"}) + "\n")
    with pytest.raises(RunDirError, match="not a run directory created by dynaresize"):
        require_run_dir(rd)
    (rd / "events.jsonl").write_text(json.dumps({"v": 1, "type": "run_start", "run_id": rd.name}) + "\n")
    assert require_run_dir(rd) == rd


def test_a_slurm_job_reuses_only_a_run_directory_dynaresize_created(tmp_path):
    """``entry prepare`` after a requeue: the job index names the run directory; one that is not a run directory
    (the index edited by hand to point at the user's folder) is not written into: a new run directory is made."""
    from dynaresize.slurm.jobdir import JOBS_INDEX, prepare_in_job

    over = [f"run.output_dir={tmp_path / 'runs'}"]
    first = prepare_in_job(str(ROOT / "configs" / "slurm-local.yaml"), over, "41")
    assert prepare_in_job(str(ROOT / "configs" / "slurm-local.yaml"), over, "41") == first  # the requeue
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("extends: x.yaml\n")
    (tmp_path / "runs" / JOBS_INDEX / "41").write_text(f"{mine}\n")
    again = prepare_in_job(str(ROOT / "configs" / "slurm-local.yaml"), over, "41")
    assert again not in (mine, first) and (again / ".dynaresize-run.json").exists()
    assert (mine / "config.yaml").read_text() == "extends: x.yaml\n" and sorted(p.name for p in mine.iterdir()) == ["config.yaml"]
