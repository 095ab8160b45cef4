"""``dynaresize config``: document every field, check a config, show it fully resolved.

    dynaresize config fields [SECTION]          one line per field: key, type, default, description
    dynaresize config check CONFIG [k=v ...]    validate, print the memory table (docs/memory.md); exit 2 with one
                                                clear message if invalid or the initial split does not fit
    dynaresize config show CONFIG [k=v ...]     the fully resolved YAML (what a run writes to its run directory)
    dynaresize config from-verl VERL.yaml [k=v ...] -o OUT.yaml
                                                a verl GRPO/DAPO config (and verl-style overrides) in this project's
                                                keys; every key not translated printed with the reason (docs/from-verl.md)
"""

from __future__ import annotations

import argparse
import json

from dynaresize.config.loader import dump_config, iter_fields, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__
    p.add_argument("action", choices=["fields", "check", "show", "from-verl"], help="what to do")
    p.add_argument("target", nargs="?", help="CONFIG file (check/show) or a section name (fields)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-5 cluster.gpus=8 (from-verl: verl's keys)")
    p.add_argument("-o", "--output", help="from-verl: where to write the translated config (default: print it)")


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
    if args.action == "from-verl":
        return from_verl(args)
    cfg = load_config(args.target, args.overrides)
    if args.action == "check":
        from dynaresize.config.memory import check_config, format_table

        rep = check_config(cfg)  # MemoryFitError (a ConfigError): one line, exit 2
        print(format_table(rep, cfg.cluster.initial_train))
        print(f"{args.target or '<defaults>'}: ok")
    else:
        print(dump_config(cfg), end="")
    return 0


def from_verl(args: argparse.Namespace) -> int:
    """Translate, print what was not translated, write (or print) the config, then check it with the real loader."""
    import sys
    from pathlib import Path

    from dynaresize import atomic
    from dynaresize.config.from_verl import describe, render, translate
    from dynaresize.config.loader import ConfigError, parse_override, read_yaml_mapping

    if not args.target:
        raise ConfigError("from-verl: give the verl config file (VERL.yaml)")
    path = Path(args.target)
    verl = read_yaml_mapping(path, "the verl config", "verl's sections")
    for text in args.overrides:  # verl's Hydra overrides: key=value, +key=value (add), ++key=value (force)
        parts, value = parse_override(text.lstrip("+"))
        d = verl
        for part in parts[:-1]:
            if not isinstance(d.get(part), dict):
                d[part] = {}
            d = d[part]
        d[parts[-1]] = value
    t = translate(verl)
    for line in describe(t):
        print(line, file=sys.stderr)
    text = render(t, str(path))
    if not args.output:
        print(text, end="")
        return 0
    atomic.write_text(args.output, text)
    print(f"wrote {args.output}: {len(t.keys)} keys translated, {len(t.untranslated)} verl keys not translated "
          "(listed above and in the file's header)", file=sys.stderr)
    try:
        load_config(args.output)
    except ConfigError as e:
        print(f"dynaresize config check {args.output}: {e}", file=sys.stderr)
        return 1
    print(f"dynaresize config check {args.output}: ok", file=sys.stderr)
    return 0

