"""``dynaresize config``: document every field, check a config, show it fully resolved.

    dynaresize config fields [SECTION]          one line per field: key, type, default, description
    dynaresize config check CONFIG [k=v ...]    validate, print the memory table (docs/memory.md); exit 2 with one
                                                clear message if invalid or the initial split does not fit
    dynaresize config show CONFIG [k=v ...]     the fully resolved YAML (what a run writes to its run directory)
"""

from __future__ import annotations

import argparse
import json

from dynaresize.config.loader import dump_config, iter_fields, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__
    p.add_argument("action", choices=["fields", "check", "show"], help="what to do")
    p.add_argument("target", nargs="?", help="CONFIG file (check/show) or a section name (fields)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-5 cluster.gpus=8")


def main(args: argparse.Namespace) -> int:
    if args.action == "fields":
        rows = [r for r in iter_fields() if not args.target or r[0].split(".")[0] == args.target]
        if not rows:
            print(f"no section {args.target!r}")
            return 2
        width = max(len(r[0]) for r in rows)
        for path, tname, default, desc in rows:
            print(f"{path:<{width}}  {tname:<10} default={json.dumps(default, default=str):<22} {desc}")
        return 0
    cfg = load_config(args.target, args.overrides)
    if args.action == "check":
        from dynaresize.config.memory import check_config, format_table

        rep = check_config(cfg)  # MemoryFitError (a ConfigError): one line, exit 2
        print(format_table(rep, cfg.cluster.initial_train))
        print(f"{args.target or '<defaults>'}: ok")
    else:
        print(dump_config(cfg), end="")
    return 0
