"""A resume's plan (what may change, what is left to train) and the summary's split, without a job."""

from __future__ import annotations

import pytest

from dynaresize.config.loader import load_config
from dynaresize.job.reporting import final_split
from dynaresize.job.resume_plan import ResumeRefused, changeable, changed_keys, plan_resume
from dynaresize.job.runtime import Job
from dynaresize.job.state import JobState, save_state


def test_the_split_counts_only_live_ranks(tmp_path):
    cfg = load_config("configs/quickstart.yaml", ["cluster.gpus=4"])
    assert final_split(Job(cfg, tmp_path, JobState(n_train=1))) == "1:3"
    assert final_split(Job(cfg, tmp_path, JobState(n_train=1, lost=[3]))) == "1:2"  # before: "1:3"
    assert final_split(Job(cfg, tmp_path, JobState(n_train=2, lost=[2, 3]))) == "2:0"


def test_a_resume_may_change_how_the_job_runs_but_not_what_it_computes(tmp_path):
    before = load_config("configs/quickstart.yaml", ["run.steps=6"])
    now = load_config("configs/quickstart.yaml", ["run.steps=9", "faults.disk_full_wait_s=5", "metrics.tensorboard=true"])
    assert set(changed_keys(before, now)) == {"run.steps", "faults.disk_full_wait_s", "metrics.tensorboard"}
    assert all(changeable(k) for k in changed_keys(before, now))
    assert not changeable("run.seed") and not changeable("rollout.group_size") and not changeable("runx.steps")
    # no checkpoint yet: the run starts from step 0 with the new length
    plan = plan_resume(tmp_path, before, now)
    assert (plan.step, plan.steps_before, plan.steps, plan.extends) == (0, 6, 9, False)
    with pytest.raises(ResumeRefused, match=r"run.seed: the run's 0, given 3"):
        plan_resume(tmp_path, before, load_config("configs/quickstart.yaml", ["run.steps=6", "run.seed=3"]))
    with pytest.raises(ResumeRefused, match=r"ranks are still running \(rank\(s\) 1, pids 4242\)"):
        plan_resume(tmp_path, before, now, live_ranks={1: 4242})
    assert plan_resume(tmp_path, before, before, live_ranks={1: 4242}).steps == 6  # a takeover without changes


def test_a_completed_run_is_extended_only_past_its_steps(tmp_path):
    """A state without a checkpoint directory is what ``select_resume`` starts from as it is (step 6 here)."""
    before = load_config("configs/quickstart.yaml", ["run.steps=6"])
    save_state(tmp_path, JobState(step=6, n_train=2, run_steps=6))
    for over in ([], ["run.steps=6"]):
        with pytest.raises(ResumeRefused, match=r"the run completed its 6 steps .* run.steps=N with N > 6"):
            plan_resume(tmp_path, before, load_config("configs/quickstart.yaml", ["run.steps=6", *over]))
    with pytest.raises(ResumeRefused, match=r"run.steps=4 leaves nothing to train: .* at step 6"):
        plan_resume(tmp_path, before, load_config("configs/quickstart.yaml", ["run.steps=4"]))
    plan = plan_resume(tmp_path, before, load_config("configs/quickstart.yaml", ["run.steps=10"]))
    assert plan.extends and (plan.step, plan.steps) == (6, 10)
