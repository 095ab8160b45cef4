"""``dynaresize eval MODEL_DIR|RUN_DIR --data FILE``: mean reward and pass@k of a model over a dataset's prompts.

The same computation as a run's validation pass (``dynaresize.job.validation``), outside any job: the prompts of the
files (the run's layouts: ``dynaresize.tasks.dataset``, docs/byo.md) rendered as rollout renders them, ``k``
responses a prompt, response ``i`` of prompt ``p`` drawn with the validation seed ``val_seed(run.seed, p, i)``,
decoded and scored by the run's reward exactly as a rollout rank scores them, then ``pass_figures``. So with the
torch engine and the run's settings, the figures of a checkpoint equal the run's own ``validation.jsonl`` record of
that version (a sample's tokens depend on its seed only; see docs/export.md for the one caveat, float near-ties).

Settings: the run's (a RUN_DIR's ``config.yaml``, or the ``run_config.yaml`` an export wrote), overridden by the
flags; a model directory of any other origin needs ``--reward`` and takes the config defaults for the rest. A RUN_DIR
is exported first (``dynaresize.models.export``, its last checkpoint or ``--step``) into a temporary directory.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dynaresize.config.loader import ConfigError


@dataclass(frozen=True)
class EvalSettings:
    data: list[str]
    max_prompts: int | None
    k: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    engine: str


def settings(cfg, args) -> EvalSettings:
    """The flags where given, else the run's validation settings (``task.dataset``, ``rollout``, ``run.seed``)."""
    ds, ro = cfg.task.dataset, cfg.rollout

    def pick(flag, *fallbacks):
        return next(v for v in (flag, *fallbacks) if v is not None)

    data = list(args.data or ds.val_files)
    if not data:
        raise ConfigError("no data: give --data FILE (the run has no task.dataset.val_files)")
    val = type(ds).model_fields  # validation's own sampling keys where this build has them (greedy: val_temperature 0)
    for flag, section, key in (("samples", ds, "val_samples"), ("max_tokens", ro, "max_tokens"), ("max_prompts", ds, "val_max_prompts"),
                               ("temperature", *((ds, "val_temperature") if "val_temperature" in val else (ro, "temperature"))),
                               ("top_p", *((ds, "val_top_p") if "val_top_p" in val else (ro, "top_p")))):
        _check(flag, section, key, getattr(args, flag))
    return EvalSettings(
        data=data, max_prompts=args.max_prompts if args.data else pick(args.max_prompts, ds.val_max_prompts, 0) or None,
        k=pick(args.samples, ds.val_samples), temperature=pick(args.temperature, getattr(ds, "val_temperature", None), ro.temperature),
        top_p=pick(args.top_p, getattr(ds, "val_top_p", None), ro.top_p), max_tokens=pick(args.max_tokens, ro.max_tokens),
        seed=pick(args.seed, cfg.run.seed), engine=args.engine)


def _check(flag: str, section, key: str, value) -> None:
    """A flag's value must be one the run's config accepts for the setting it stands for (the schema's own rule)."""
    from pydantic import ValidationError

    if value is None:
        return
    try:
        type(section).model_validate({**section.model_dump(), key: value})
    except ValidationError as e:
        raise ConfigError(f"--{flag.replace('_', '-')} {value}: {e.errors()[0]['msg']} "
                          f"(the rule of {key})") from None


def run_config(model_dir: Path | None, run_dir: Path | None, reward: str | None):
    """The config the figures are computed under: the run's, an export's copy of it, else the defaults."""
    from dynaresize.config.loader import load_config
    from dynaresize.models.export import RUN_CONFIG

    path = run_dir / "config.yaml" if run_dir else (model_dir / RUN_CONFIG if (model_dir / RUN_CONFIG).is_file() else None)
    overrides = [f"reward.function={reward}"] if reward else []
    if path is None and not reward:
        raise ConfigError(f"{model_dir} is not a dynaresize export (no {RUN_CONFIG}): give --reward "
                          "module:function (or path/to/file.py:function)")
    return load_config(path, overrides)


def generate(model_dir: Path, prompt_ids: list[list[int]], seeds: list[int], st: EvalSettings, cfg, eos: list[int], pad: int):
    """Responses (``Generation``s) of the torch engine (the run's ``TorchRollout``) or vLLM (``VllmRollout``)."""
    from dynaresize.engines.protocol import SamplingParams
    from dynaresize.models.hf import model_dtype

    params = SamplingParams(max_tokens=st.max_tokens, temperature=st.temperature, top_p=st.top_p)
    dtype = model_dtype(model_dir, "auto")
    if st.engine == "vllm":
        import torch

        from dynaresize.engines.rollout_vllm import VllmRollout

        engine = VllmRollout(str(model_dir), eos, cfg.rollout.vllm, seed=st.seed, dtype=str(dtype).removeprefix("torch."),
                             platform="cuda" if torch.cuda.is_available() else "cpu", max_seqs=cfg.rollout.kv_slots)
        return engine.generate(prompt_ids, seeds, params)
    from dynaresize.engines.rollout_torch import TorchRollout
    from dynaresize.models.hf import load_model

    engine = TorchRollout(load_model(model_dir, dtype), eos, pad, max_running=cfg.rollout.kv_slots)  # the run's KV slots
    return engine.generate(prompt_ids, seeds, params)


def prompts(st: EvalSettings):
    """The records of the data files (checked as a run checks them: file, row, field) and where the first chat
    prompt is (None: all strings)."""
    from dynaresize.tasks.dataset import read_records

    samples, chat = read_records(st.data, "--data")
    return (samples[: st.max_prompts] if st.max_prompts else samples), chat


def evaluate(model_dir: Path, cfg, st: EvalSettings, samples, chat: str | None, version: int = 0) -> tuple[dict, list[dict]]:
    """The figures (``pass_figures`` plus reward errors) and one record per response."""
    from dynaresize.job.batching import val_items
    from dynaresize.job.validation import pass_figures
    from dynaresize.models.hf import check_chat_template, load_tokenizer, pad_token_id, stop_token_ids
    from dynaresize.worker.main import _scorer

    tok = load_tokenizer(model_dir)
    if chat is not None:
        check_chat_template(tok, model_dir, chat)
    items = val_items(samples, tok, st.seed, version, st.k)
    gens = generate(model_dir, [it.prompt_ids for it in items], [it.seed for it in items], st, cfg,
                    stop_token_ids(model_dir, tok), pad_token_id(tok))
    score = _scorer(cfg, tok)
    rows = []
    for it, g in zip(items, gens):
        s = score(it, g.token_ids)
        rows.append({"key": it.key, "prompt": it.prompt, "index": it.index, "seed": it.seed,
                     "ground_truth": it.info.get("ground_truth"), "response": tok.decode(g.token_ids, skip_special_tokens=True),
                     "tokens": len(g.token_ids), "token_ids": list(g.token_ids), "logprobs": list(g.logprobs), **s})
    figures = {**pass_figures([r["reward"] for r in rows], st.k), "reward_errors": sum(1 for r in rows if r.get("reward_error"))}
    return figures, rows


def run_validation(run_dir: Path | None, version: int | None) -> dict | None:
    """The run's own validation record of ``version`` (``validation.jsonl``), when there is one."""
    if run_dir is None or version is None:
        return None
    try:
        lines = (run_dir / "validation.jsonl").read_text().splitlines()
    except OSError:
        return None
    recs = [json.loads(l) for l in lines if l.strip()]
    return next((r for r in reversed(recs) if r.get("version") == version), None)


# -- the command -------------------------------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("target", metavar="MODEL_DIR|RUN_DIR", help="an HF model directory (an export, or any) or a run directory")
    p.add_argument("--data", nargs="+", metavar="FILE", help="prompt files (.jsonl/.json/.parquet, the run's layout; "
                   "default: the run's task.dataset.val_files)")
    p.add_argument("--samples", type=int, metavar="K", help="responses a prompt: the k of pass@k (default: task.dataset.val_samples)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: the run's validation temperature)")
    p.add_argument("--top-p", type=float, help="nucleus sampling (default: the run's)")
    p.add_argument("--max-tokens", type=int, help="response length limit (default: rollout.max_tokens)")
    p.add_argument("--seed", type=int, help="seed of the per-response draws (default: run.seed, as validation)")
    p.add_argument("--max-prompts", type=int, help="the first N prompts only (default: all; the run's val_max_prompts without --data)")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch", help="generation engine (default: torch)")
    p.add_argument("--step", type=int, help="RUN_DIR: the checkpoint of this step (default: the last one)")
    p.add_argument("--reward", metavar="MODULE:FUNCTION", help="reward function (default: the run's reward.function)")
    p.add_argument("--out", metavar="FILE", help="write one JSON line per response (prompt, index, seed, response, its "
                   "token ids and their logprobs under the sampling distribution, reward)")


def _table(fig: dict, st: EvalSettings, own: dict | None) -> str:
    rows = [("prompts", fig["prompts"]), ("responses a prompt (k)", st.k), ("mean reward", f"{fig['reward_mean']:.6f}"),
            (f"pass@{st.k}", f"{fig['pass_at_k']:.6f}"), ("reward errors", fig["reward_errors"]),
            ("engine / temperature / top_p / max tokens / seed", f"{st.engine} / {st.temperature} / {st.top_p} / {st.max_tokens} / {st.seed}")]
    if own is not None:
        rows.append(("the run's validation of this version", f"mean reward {own['reward_mean']:.6f}, pass@{own['k']} {own['pass_at_k']:.6f}"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(args) -> int:
    from dynaresize.models.export import EXPORT_FILE, export
    from dynaresize.models.hf import offline
    from dynaresize.rewards import load_reward

    offline()
    target = Path(args.target).expanduser()
    is_model = (target / "config.json").is_file()
    if not is_model and not (target / "config.yaml").is_file():
        raise ConfigError(f"{target}: neither a model directory (config.json) nor a run directory (config.yaml)")
    if is_model and args.step is not None:
        raise ConfigError(f"--step picks a run's checkpoint; {target} is a model directory")
    rec = json.loads((target / EXPORT_FILE).read_text()) if is_model and (target / EXPORT_FILE).is_file() else {}
    cfg = run_config(target if is_model else None, None if is_model else target, args.reward)
    st = settings(cfg, args)  # bad flags and data fail here, before any export or model load
    samples, chat = prompts(st)
    load_reward(cfg)  # an unusable reward fails here too (the ranks' scorer loads it again)
    with tempfile.TemporaryDirectory(prefix="dynaresize-eval-") as tmp:
        if is_model:
            model_dir, source = target, Path(rec["run_dir"]) if rec.get("run_dir") else None
        else:
            model_dir, source = Path(tmp) / "model", target
            rec = export(target, model_dir, args.step)
        version = rec.get("version")
        fig, rows = evaluate(model_dir, cfg, st, samples, chat, version or 0)
    own = run_validation(source, version)
    print(_table(fig, st, own))
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    out = {"model": str(target), "step": rec.get("step"), "version": version, **fig, "engine": st.engine,
           "temperature": st.temperature, "top_p": st.top_p, "max_tokens": st.max_tokens, "seed": st.seed,
           "data": st.data, "run_validation": own}
    print(json.dumps(out, separators=(",", ":")))
    sys.stdout.flush()
    return 0
