"""Benchmark of one rollout rank: tokens/s and the idle share between commands, per engine, through the real command
path (a private real redis-server, the CommandBus in a coordinator process, the rank's CommandReceiver and Worker).

    python tools/bench_rollout.py [--batches 4] [--prompts 16] [--group 8] [--groups-per-command 4] [--rounds 2]
                                  [--no-vllm]

The coordinator process sends the command stream the continuous schedule sends one rollout rank
(dynaresize/job/handout.py): ``generate`` commands of ``--groups-per-command`` GRPO groups, two queued at a time
(``SLOTS``; the next one sent when an ack arrives), batch ``j`` with version ``max(0, j - 1)``, a ``fetch_weights``
before the first command of a new version (snapshots staged before the clock starts). Engines, side by side on the
same commands, prompts, seeds and weights, in alternating order over ``--rounds`` rounds (the median is reported):

- ``torch one batch``: ``rollout.max_running=0``, each command's ``pull_batch`` rows decoded together to the end;
- ``torch continuous``: ``rollout.max_running`` unset, as many KV slots as the one-batch row decodes rows
  (``pull_batch`` = one command's samples): the queued command's samples enter as slots free;
  ``torch continuous, 2 commands' slots``: ``max_running`` = both queued commands' samples (``--max-running``
  otherwise): every queued sample runs at once, and the rank idles when both commands end before the next arrives;
- ``vllm``: the rank's engine is :class:`~dynaresize.engines.rollout_vllm.VllmRollout` (vLLM's CPU build, in this
  process, float32), built once before any clock from the same random-init model saved as an HF directory
  (config.json and safetensors; no tokenizer: token ids in and out), warmed up with one command's samples, and
  loaded with version 0 at each run as a rank loads it (``Worker._build_rollout``). Continuous batching is vLLM's
  own request/step loop (``add_request`` / ``step``) over the rank's KV slots as a rank builds it: ``max_num_seqs``
  = ``rollout.max_running``, else ``pull_batch`` (the slots column: one command's samples, as the torch continuous
  row). A new version goes through the same ``fetch_weights`` (file transport) and
  install path, the install being vLLM's in-place reload (``finish_weight_update``). Its tokens come from vLLM's
  kernels and sampler, so its samples are not compared with the torch rows' (which must agree token for token);
  every row is checked to complete every sample, each with its batch's version (``max(0, j - 1)``). The row says
  why when vLLM does not import or its engine does not build or run (``--no-vllm``: skipped).

Measured per engine: ``tokens_per_s`` = response tokens / the rank's span (first rollout stage start to the last
end); ``tokens_per_cpu_s`` = response tokens / the rank process's CPU seconds (steadier than wall time on cores
other jobs share: the rank computes on one thread); ``idle_share`` = the part of that span in no rollout stage
interval (the rank waiting for a command or committing an ack; target <= 2 %); ``idle_share_within_version`` leaves
out the waits before a new version's first command: the old version's last acks, the install of the fetched version
(``install``: its mean per version; a fetch itself runs beside the decode and is acked at once, so the new version's
first command is usually queued before the old version's samples end, and waits for them), the new command's claim,
and a round trip when the old version's commands both ended before it arrived. The model is a random-init model of
the quickstart's tiny shape (hidden 128, 2 layers, vocabulary 384) with 38 of its 384 tokens ending a response
(lengths roughly geometric, mean ~10, capped at ``--max-tokens`` 28, the quickstart's): what matters is the spread
of the lengths. Prints a table, then one JSON line. Wall-clock figures on shared cores are noisy; compare the rows
of one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

JOB = "bench-rollout"
SLOTS = 2  # generate commands queued per rollout rank (the runtime holds one command and a group: handout.QUEUED_GROUPS)
EOS = list(range(300, 338))  # 38 of 384 tokens end a response
TINY = {"vocab_size": 384, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True}


def work(batch: int, prompts: int, group: int):
    from dynaresize.contract.workqueue import WorkItem

    rng = random.Random(batch)
    out = []
    for p in range(prompts):
        ids = [rng.randrange(1, 290) for _ in range(rng.randrange(4, 13))]
        out += [WorkItem(batch, p, i, ids, seed=(batch * 1000 + p) * 100 + i) for i in range(group)]
    return out


def coordinator(endpoint: str, cfg_json: str, job: str, args_json: str, done) -> None:
    """The command stream of the continuous schedule for one rollout rank, then ``shutdown``."""
    from dynaresize.control.commands import CommandBus
    from dynaresize.control.config import RedisConfig
    from dynaresize.control.server import connect

    a = json.loads(args_json)
    cfg = RedisConfig.model_validate_json(cfg_json)
    bus = CommandBus(connect(endpoint, role="coordinator", cfg=cfg), job, cfg)
    gen = {"pull_batch": a["group"] * a["groups_per_command"], "max_tokens": a["max_tokens"], "temperature": 1.0,
           "top_p": 1.0}
    plan = []  # (kind, payload)
    held = 0
    for j in range(a["batches"]):
        v = max(0, j - 1)
        if v > held:
            plan.append(("fetch_weights", {"version": v}))
            held = v
        for g in range(0, a["prompts"], a["groups_per_command"]):
            plan.append(("generate", {"step": j, "version": v, "prompts": list(range(g, g + a["groups_per_command"])), **gen}))
    inflight: dict[str, str] = {}
    cursors: dict[str, bytes] = {}
    i = 0
    while i < len(plan) or inflight:
        while i < len(plan) and (plan[i][0] != "generate" or sum(k == "generate" for k in inflight.values()) < SLOTS):
            kind, payload = plan[i]
            cmd = bus.send(kind, [0], payload)
            inflight[cmd.command_id], cursors[cmd.command_id] = kind, b"0-0"
            i += 1
        for ack in bus.read_acks(cursors, 1.0):
            if not ack.ok:
                raise RuntimeError(f"rank 0 failed {inflight[ack.command_id]}: {ack.error}")
            inflight.pop(ack.command_id, None)
            cursors.pop(ack.command_id, None)
    bus.send("shutdown", [0], {})
    done.set()


def one_run(name: str, max_running: int | None, a: argparse.Namespace, redis_srv, module, root: Path, rnd: int,
            vllm=None) -> dict:
    """One engine over the whole command stream (``vllm``: the rank's engine is that VllmRollout, else the torch
    engine over ``module``); returns its tokens, span and busy time from the rank's events."""
    from dynaresize.contract.dataplane import RedisDataPlane
    from dynaresize.contract.workqueue import RolloutQueue
    from dynaresize.control.commands import CommandReceiver
    from dynaresize.control.server import connect
    from dynaresize.events import EventLog, read_events
    from dynaresize.worker.local import rollout_rank
    from dynaresize.worker.main import RankHandler

    job = f"{JOB}-{rnd}-{''.join(c if c.isalnum() else '-' for c in name)}"
    cfg = redis_srv.cfg
    client = connect(redis_srv.endpoint_file, role="rank0", cfg=cfg)
    queue = RolloutQueue(client, job)
    for j in range(a.batches):
        queue.publish(j, work(j, a.prompts, a.group))
    run_dir = root / job
    run_dir.mkdir()
    events = EventLog(run_dir / "events.jsonl")
    pull = a.group * a.groups_per_command
    worker = rollout_rank(module, RedisDataPlane(client, job), run_dir / "stage", root / "weights",
                          rollout={"max_running": max_running, "pull_batch": pull, "max_tokens": a.max_tokens},
                          eos_ids=EOS, events=events, vllm=vllm)
    recv = CommandReceiver(client, job, 0, cfg)
    handler = RankHandler(worker)
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    args_json = json.dumps({k: getattr(a, k) for k in ("batches", "prompts", "group", "groups_per_command", "max_tokens")})
    coord = ctx.Process(target=coordinator, args=(str(redis_srv.endpoint_file), cfg.model_dump_json(), job, args_json, done))
    coord.start()
    cpu0 = time.process_time()
    try:
        recv.run_stream(handler, stop=lambda: worker.stopped, idle_s=0.2)
        cpu = time.process_time() - cpu0  # the rank's CPU seconds (this process: one compute thread)
    finally:
        recv.close()
        coord.join(timeout=60)
        events.close()
    if coord.exitcode != 0:
        raise RuntimeError(f"{name}: the coordinator process failed (exit {coord.exitcode})")
    evs = [e for e in read_events(run_dir / "events.jsonl") if e.type.value == "stage"]
    stages = sorted(((e["start"], e["end"], e.get("tokens", 0), e.get("version"))
                     for e in evs if e.get("stage") == "rollout"), key=lambda s: s[0])
    # a new version's install into the engine (after the old version's samples ended, before the new ones start;
    # not the background read of the snapshot): part of the wait at that version
    installs = [e["end"] - e["start"] for e in evs if e.get("stage") == "weight_sync" and not e.get("background")]
    span = stages[-1][1] - stages[0][0]
    busy, end, boundary = 0.0, float("-inf"), 0.0
    for i, (s, e, _, v) in enumerate(stages):  # union of the intervals (they do not overlap; a guard all the same)
        if i and v != stages[i - 1][3]:
            boundary += max(0.0, s - end)  # the wait at a new version: the old one's acks, the fetch, the next command
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    tokens = sum(t for _, _, t, _ in stages)
    samples = [r for j in range(a.batches) for r in queue.results(j)]
    expect = a.batches * a.prompts * a.group
    if len(samples) != expect:
        raise RuntimeError(f"{name}: {len(samples)} samples completed, {expect} expected")
    wrong = sum(r.version != max(0, r.step - 1) for r in samples)  # batch j is generated with version max(0, j - 1)
    samples = {r.key: (tuple(r.response_ids), r.version) for r in samples}
    return {"tokens": tokens, "span_s": span, "busy_s": busy, "boundary_s": boundary, "commands": len(stages),
            "cpu_s": cpu, "samples": samples, "wrong_version": wrong,
            "install_s": statistics.mean(installs) if installs else 0.0}


def vllm_engine(module, root: Path, a: argparse.Namespace):
    """(the vLLM engine, None), or (None, why not in one line). The random-init model is saved as an HF directory
    (config.json, safetensors; no tokenizer: token ids in and out) for vLLM to load, the engine is built as a
    rank's (float32, the KV cache an explicit size), then warmed up with one command's worth of samples (its first
    steps take seconds) before any clock starts."""
    from dynaresize.engines.protocol import SamplingParams
    from dynaresize.engines.rollout_vllm import VllmRollout, import_vllm
    from dynaresize.worker.config import VllmConfig

    try:
        import_vllm()
    except Exception as e:  # noqa: BLE001 - any import failure: the row says so
        return None, f"not installed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    try:
        model_dir = root / "model"
        module.save_pretrained(model_dir)
        cfg = VllmConfig(cpu_kv_cache_mb=64, max_model_len=TINY["max_position_embeddings"])
        eng = VllmRollout(str(model_dir), EOS, cfg, platform="cpu", max_seqs=a.group * a.groups_per_command)
        items = work(999, a.groups_per_command, a.group)  # not a batch of the stream
        eng.generate([it.prompt_ids for it in items], [it.seed for it in items],
                     SamplingParams(max_tokens=a.max_tokens))
    except Exception as e:  # noqa: BLE001 - the row says why
        lines = [x for x in f"{type(e).__name__}: {e}".splitlines() if x.strip()]
        return None, f"its engine did not build or run on CPU: {lines[-1][:300]}"
    return eng, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=4, help="RL batches (a new version from batch 2 on)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per batch (the quickstart's B)")
    ap.add_argument("--group", type=int, default=8, help="responses per prompt (G)")
    ap.add_argument("--groups-per-command", type=int, default=4, help="pipeline.groups_per_command (the default)")
    ap.add_argument("--max-tokens", type=int, default=28, help="rollout.max_tokens (the quickstart's)")
    ap.add_argument("--max-running", type=int, default=0, help="slots of the last torch row (0: 2 commands' worth)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the engines, alternating order; medians")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vllm row (its engine build takes ~10-25 s)")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's INFO lines (and a harmless chat-template warm-up
    # warning: the directory has no tokenizer) would bury the table
    import torch

    torch.set_num_threads(1)
    from dynaresize.control.config import RedisConfig
    from dynaresize.control.server import RedisServer
    from dynaresize.staging import Stager
    from dynaresize.worker.local import tiny_qwen2

    pull = a.group * a.groups_per_command
    engines = [("torch one batch", 0), ("torch continuous", None),
               ("torch continuous, 2 commands' slots" if not a.max_running else "torch continuous, --max-running",
                a.max_running or SLOTS * pull)]
    torch_rows = [n for n, _ in engines]
    module = tiny_qwen2(TINY, seed=0).eval()
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        root = Path(tmp)
        vllm, vwhy = (None, "skipped (--no-vllm)") if a.no_vllm else vllm_engine(module, root, a)
        if vllm is not None:  # its own scheduler admits up to max_num_seqs requests (the rank's slots)
            engines.append(("vllm", int(vllm.engine.vllm_config.scheduler_config.max_num_seqs)))
        results: dict[str, list[dict]] = {n: [] for n, _ in engines}
        stager = Stager(root / "stage", 8, 4, 1)
        base = {n: p.detach().clone() for n, p in module.named_parameters()}
        g = torch.Generator().manual_seed(1)
        for v in range(1, a.batches):  # the versions the stream installs, staged before any clock starts
            stager.stage(str(root / "weights" / f"v{v}"),
                         {n: t + 0.01 * v * torch.randn(t.shape, generator=g) for n, t in base.items()}, {"version": v})
        with RedisServer(RedisConfig(), root / "redis-run") as srv:
            for rnd in range(a.rounds):
                order = engines if rnd % 2 == 0 else engines[::-1]
                for name, slots in order:
                    with torch.no_grad():  # every run starts from version 0's weights (the vLLM rank loads them)
                        for n, p in module.named_parameters():
                            p.copy_(base[n])
                    results[name].append(one_run(name, None if name == "vllm" else slots, a, srv, module, root, rnd,
                                                 vllm=vllm if name == "vllm" else None))
    # the torch rows decode each sample with the same kernels and sampler: the same tokens (near-ties aside); vLLM's
    # kernels and sampler are its own, so its row is held to its sample count and versions only
    ref = results[engines[0][0]][0]["samples"]
    differ = max(sum(r["samples"][k] != v for k, v in ref.items()) for n in torch_rows for r in results[n])
    wrong = {n: max(r["wrong_version"] for r in rs) for n, rs in results.items()}
    table = {}
    for name, slots in engines:
        rs = results[name]
        tps = statistics.median(r["tokens"] / r["span_s"] for r in rs)
        tpc = statistics.median(r["tokens"] / r["cpu_s"] for r in rs)
        idle = statistics.median(1.0 - r["busy_s"] / r["span_s"] for r in rs)
        within = statistics.median((r["span_s"] - r["busy_s"] - r["boundary_s"]) / r["span_s"] for r in rs)
        gap = statistics.median((r["span_s"] - r["busy_s"]) / max(1, r["commands"] - 1) * 1e3 for r in rs)
        table[name] = {"slots": slots or pull, "tokens_per_s": round(tps, 1), "tokens_per_cpu_s": round(tpc, 1),
                       "idle_share": round(idle, 4),
                       "idle_share_within_version": round(within, 4),
                       "gap_ms": round(gap, 2), "tokens": rs[0]["tokens"],
                       "install_ms": round(statistics.median(r["install_s"] for r in rs) * 1e3, 2)}
    one, one_cpu = table["torch one batch"]["tokens_per_s"], table["torch one batch"]["tokens_per_cpu_s"]
    print(f"one rollout rank, {a.batches} batches x {a.prompts} prompts x {a.group} responses, "
          f"{a.groups_per_command} groups per command, {SLOTS} commands queued, {a.rounds} rounds (medians)")
    print(f"{'engine':36s} {'slots':>5s} {'tokens/s':>9s} {'x':>5s} {'tokens/cpu-s':>12s} {'x':>5s} "
          f"{'idle share':>10s} {'within a version':>16s} {'gap/command':>11s} {'install':>9s}")
    for name, row in table.items():
        print(f"{name:36s} {row['slots']:5d} {row['tokens_per_s']:9.0f} {row['tokens_per_s'] / one:5.2f} "
              f"{row['tokens_per_cpu_s']:12.0f} {row['tokens_per_cpu_s'] / one_cpu:5.2f} "
              f"{100 * row['idle_share']:9.2f}% {100 * row['idle_share_within_version']:15.2f}% {row['gap_ms']:9.2f}ms "
              f"{row['install_ms']:7.1f}ms")
    if vwhy:
        print(f"{'vllm':36s} {vwhy}")
    print(f"samples whose tokens or version differ between the torch rows (near-ties only): {differ} of {len(ref)}")
    print("samples generated with another version than their batch's (max(0, batch - 1)): "
          + ", ".join(f"{n} {k}" for n, k in wrong.items()))
    if vllm is not None:
        print(f"vllm: every run completed all {len(ref)} samples; its tokens are its own sampler's (not compared)")
    out = {"tokens_per_s": {n: r["tokens_per_s"] for n, r in table.items()},
           "tokens_per_cpu_s": {n: r["tokens_per_cpu_s"] for n, r in table.items()},
           "idle_share": {n: r["idle_share"] for n, r in table.items()},
           "idle_share_within_version": {n: r["idle_share_within_version"] for n, r in table.items()},
           "install_ms": {n: r["install_ms"] for n, r in table.items()},
           "vllm": vwhy or "measured", "samples_differing": differ, "wrong_version": wrong, "samples": len(ref),
           "target_idle_share": 0.02}
    print(json.dumps(out))
    return 1 if any(wrong.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
