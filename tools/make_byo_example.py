"""Write the bring-your-own-data example: arithmetic word problems as Parquet files in verl's layout, offline.

What it makes (deterministic for a seed): ``train.parquet`` and ``val.parquet`` under ``--out`` (default
``runs/data/byo-example``, the paths ``configs/byo-example.yaml`` reads), one row per problem::

    prompt        [{"role": "user", "content": "Ann has 3 pens and buys 2 more. How many pens does Ann have now?
                    Put the final answer in \\boxed{}."}]
    data_source   "byo_arith"
    reward_model  {"style": "rule", "ground_truth": "5"}
    extra_info    {"split": "train", "index": 12, "answer": "\\boxed{5}"}

``extra_info.answer`` is what the tiny model's supervised warm-start imitates; the built-in math reward
(``dynaresize.rewards.math:compute_score``) scores the boxed number. A first operand 0..9, a second 1..3, addition
and subtraction (never below zero), eight names, eight objects, three phrasings of each operation. Validation problems are drawn apart from the training ones (no prompt appears in both).

    .venv/bin/python tools/make_byo_example.py                 # then: .venv/bin/dynaresize run configs/byo-example.yaml
    .venv/bin/python tools/make_byo_example.py --out /tmp/arith --train 500 --val 32 --jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gus", "Hana")
THINGS = ("apple", "pen", "book", "coin", "cup", "egg", "hat", "key")
ADD = ("{n} has {a} {t}s and buys {b} more.", "{n} has {a} {t}s and finds {b} more.", "{n} has {a} {t}s and gets {b} more.")
SUB = ("{n} has {a} {t}s and gives away {b}.", "{n} has {a} {t}s and loses {b}.", "{n} has {a} {t}s and sells {b}.")
MAX_STEP = 3  # the second operand: 1..3 (a tiny model learns it within minutes; 0..9 took it far longer)
QUESTION = " How many {t}s does {n} have now? Put the final answer in \\boxed{{}}."


def problem(rng: random.Random) -> tuple[str, int, str]:
    """(question, result, worked answer) of one random problem."""
    n, t = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randrange(10), rng.randrange(1, MAX_STEP + 1)
    if rng.random() < 0.5 or a < b:
        text, result = rng.choice(ADD), a + b
    else:
        text, result = rng.choice(SUB), a - b
    question = text.format(n=n, a=a, b=b, t=t) + QUESTION.format(n=n, t=t)
    return question, result, f"\\boxed{{{result}}}"


def records(n: int, split: str, rng: random.Random, exclude: set[str]) -> list[dict]:
    out, seen = [], set(exclude)
    while len(out) < n:
        q, r, worked = problem(rng)
        if q in seen:
            continue
        seen.add(q)
        out.append({
            "prompt": [{"role": "user", "content": q}],
            "data_source": "byo_arith",
            "reward_model": {"style": "rule", "ground_truth": str(r)},
            "extra_info": {"split": split, "index": len(out), "answer": worked},
        })
    return out


def write(rows: list[dict], path: Path, jsonl: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if jsonl:
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/data/byo-example", help="output directory (train.parquet, val.parquet)")
    ap.add_argument("--train", type=int, default=2000, help="training problems")
    ap.add_argument("--val", type=int, default=64, help="validation problems (none of them in the training set)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jsonl", action="store_true", help="write JSONL instead of Parquet")
    args = ap.parse_args(argv)
    rng = random.Random(f"byo-example:{args.seed}")
    val = records(args.val, "val", rng, set())
    train = records(args.train, "train", rng, {r["prompt"][0]["content"] for r in val})
    out = Path(args.out)
    paths = [write(train, out / "train.parquet", args.jsonl), write(val, out / "val.parquet", args.jsonl)]
    for p, rows in zip(paths, (train, val)):
        print(f"{p}: {len(rows)} problems")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
