"""Critical-path time of a role switch: DynaResize (process reuse + communicator reuse + in-memory reshard with the
optimizer state deferred to the first step) against a naive switch (save state to disk, terminate the workers,
start new processes, ``init_process_group``, load weights and optimizer state from disk, build the engine).

One command, both sides in one run, same model and state (a config-built Qwen2 of ~30M parameters on CPU):

    .venv/bin/python tools/bench_switch.py            # ~2-4 min on 2 cores
    .venv/bin/python tools/bench_switch.py --hidden 256 --layers 4   # smaller, faster

Scenario: 3 worker ranks, 1 trainer + 2 rollout ranks; rank 1 becomes a trainer (1 -> 2 trainers).
- dynaresize_s: wall time of the ``switch_role`` command, sent to all ranks, until every rank acked.
- naive_s: from the start of the checkpoint write until both new trainer processes report their engine built
  and optimizer state loaded.
Prints a table, then one JSON line: naive_s, dynaresize_s, speedup (+ details).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_spec(hidden: int, layers: int, vocab: int) -> dict:
    heads = max(2, hidden // 64)
    return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads, "max_position_embeddings": 256,
            "tie_word_embeddings": True}


def naive_child(args: argparse.Namespace) -> int:
    """A freshly started trainer process of the naive path: everything a restart pays, then READY."""
    t_start = time.time()
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch

    torch.set_num_threads(1)
    from dynaresize.comm import groups as G
    from dynaresize.engines.reshard import plan
    from dynaresize.engines.trainer_deepspeed import Partition, ZeroTrainer, preload
    from dynaresize.staging import Stager
    from dynaresize.worker.config import TrainConfig
    from dynaresize.worker.local import tiny_qwen2

    preload()
    t_import = time.time()
    G.init_world(args.rank, args.world, "127.0.0.1", args.port)
    import torch.distributed as dist

    t_comm = time.time()
    spec = json.loads(args.spec)
    model = tiny_qwen2(spec)  # architecture, then the weights from disk
    st = Stager(args.ckpt_root, buffer_mb=64, chunk_mb=8)
    st.load(args.weights, into=dict((n, p.detach()) for n, p in model.named_parameters()))
    t_load = time.time()
    tr = ZeroTrainer(model, TrainConfig(lr=1e-3, zero_stage=1), dist.group.WORLD, tuple(range(args.world)), args.batch)
    t_build = time.time()
    full, meta = st.load(args.optim)
    parts = []
    for lay in tr.layouts():
        g = lay.group
        pm = next(p for p in meta["partitions"] if p["group"] == g)
        new = {k: torch.zeros(lay.size) for k in ("master", "exp_avg", "exp_avg_sq")}
        for c in plan(lay.length, pm["dp"], pm["size"], lay.dp, lay.size, g):
            if c.dst == lay.dp_rank:
                for k in new:
                    new[k][c.start - lay.start:c.end - lay.start] = full[f"g{g}.{k}"][c.start - c.src * pm["size"]:c.end - c.src * pm["size"]]
        parts.append(Partition(lay, new["master"], new["exp_avg"], new["exp_avg_sq"], pm["step"]))
    tr.install_partitions(parts)
    dist.barrier()
    t_ready = time.time()
    print("READY " + json.dumps({"rank": args.rank, "start": t_start, "import": t_import - t_start, "comm_init": t_comm - t_import,
                                 "weight_load": t_load - t_comm, "engine_build": t_build - t_load,
                                 "optimizer_load": t_ready - t_build, "ready": t_ready}), flush=True)
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--naive-child", action="store_true", help=argparse.SUPPRESS)
    for a in ("rank", "world", "port"):
        ap.add_argument(f"--{a}", type=int, default=0, help=argparse.SUPPRESS)
    for a in ("spec", "ckpt-root", "weights", "optim"):
        ap.add_argument(f"--{a}", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.naive_child:
        return naive_child(args)

    import torch

    from dynaresize.net import free_port
    from dynaresize.worker.local import LocalCluster
    from tests.support.hooks import HOOKS

    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-switch-"))
    spec = model_spec(args.hidden, args.layers, args.vocab)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).tolist()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    os.environ.update({k: env[k] for k in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "DS_ACCELERATOR")})
    rows = []

    with torch.device("meta"):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        n_params = sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**spec)).parameters())
    print(f"starting 3 worker ranks, model {n_params / 1e6:.1f}M parameters", flush=True)
    c = LocalCluster(3, 1, work, global_batch=args.batch, model=spec, config={"train": {"lr": 1e-3}}, timeout_s=600,
                     events=work / "events.jsonl", hooks=HOOKS)  # train_direct, comm_stats: the tests' commands
    try:
        c.call("train_direct", {"input_ids": ids, "n_train": 1, "version_after": 1}, ranks=[0])
        c.call("sync_weights", {"version": 1, "n_train": 1})
        # --- DynaResize: rollout rank 1 becomes a trainer, in place
        t0 = time.perf_counter()
        res = c.call("switch_role", {"switch_id": "bench-grow", "step": 1, "from_train": 1, "to_train": 2})
        dyn_s = time.perf_counter() - t0
        for op in res[1]["ops"]:
            rows.append(("dynaresize", f"rank 1 {op['op']}", op["seconds"], "critical" if op["critical"] else "background"))
        t0 = time.perf_counter()
        c.call("train_direct", {"input_ids": ids, "n_train": 2, "version_after": 2}, ranks=[0, 1])
        first_step = time.perf_counter() - t0
        rows.append(("dynaresize", "first train step (incl. deferred optimizer stage-in)", first_step, "not in switch"))
        t0 = time.perf_counter()
        c.call("train_direct", {"input_ids": ids, "n_train": 2, "version_after": 3}, ranks=[0, 1])
        rows.append(("dynaresize", "second train step (for comparison)", time.perf_counter() - t0, "not in switch"))
        c.call("sync_weights", {"version": 3, "n_train": 2})
        t0 = time.perf_counter()
        c.call("switch_role", {"switch_id": "bench-shrink", "step": 3, "from_train": 2, "to_train": 1})
        back_s = time.perf_counter() - t0
        rows.append(("dynaresize", "switch back 2 -> 1 trainers", back_s, "critical"))
        created = max(s["created_after_startup"] for s in c.call("comm_stats").values())
        # --- naive: checkpoint to disk, kill, restart, init_process_group, load, build
        t_naive0 = time.time()
        staged = c.call("stage_state", {"tag": "naive"}, ranks=[0])[0]
        t_saved = time.time()
        rows.append(("naive", "save weights + optimizer to disk", t_saved - t_naive0, "critical"))
    finally:
        for p in c.procs:
            p.terminate()
        for p in c.procs:
            p.join(timeout=30)
    t_killed = time.time()
    rows.append(("naive", "terminate worker processes", t_killed - t_saved, "critical"))
    port = free_port()
    root = Path(staged["manifests"][0]).parent.parent
    procs = [subprocess.Popen([sys.executable, __file__, "--naive-child", "--rank", str(r), "--world", "2", "--port", str(port),
                               "--spec", json.dumps(spec), "--ckpt-root", str(root), "--weights", "naive-rank0-weights",
                               "--optim", "naive-rank0-optim", "--batch", str(args.batch)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env) for r in range(2)]
    ready = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        line = next((l for l in out.splitlines() if l.startswith("READY ")), None)
        if line is None:
            raise SystemExit(f"naive child failed (exit {p.returncode}):\n{out[-2000:]}")
        ready.append(json.loads(line[6:]))
    naive_s = max(r["ready"] for r in ready) - t_naive0
    r1 = max(ready, key=lambda r: r["ready"])
    rows.append(("naive", "process start + imports", r1["import"] + (r1["start"] - t_killed), "critical"))
    for k in ("comm_init", "weight_load", "engine_build", "optimizer_load"):
        rows.append(("naive", k, r1[k], "critical"))

    print(f"\n{'path':<11} {'operation':<55} {'seconds':>8}  kind")
    for path, op, s, kind in rows:
        print(f"{path:<11} {op:<55} {s:8.3f}  {kind}")
    speed = naive_s / dyn_s if dyn_s > 0 else float("inf")
    print(f"\nnaive switch {naive_s:.3f} s, DynaResize switch {dyn_s:.3f} s: {speed:.1f}x (target 10x); "
          f"process groups created after start-up: {created}")
    print(json.dumps({"naive_s": round(naive_s, 4), "dynaresize_s": round(dyn_s, 4), "speedup": round(speed, 2),
                      "switch_back_s": round(back_s, 4), "first_step_after_s": round(first_step, 4),
                      "groups_created_after_startup": created, "params_m": round(n_params / 1e6, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
