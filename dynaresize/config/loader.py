"""Load an experiment: YAML file(s) with ``extends``, dotted command-line overrides, typed validation.

Layering, lowest first: the model's defaults, the base file(s) named by ``extends`` (recursively, paths relative to
the file that names them), the file itself, then ``key.path=value`` overrides from the command line. Every leaf
remembers where it came from, so a validation error names the file (or the override), the key path, the value
and what is allowed, in one line per problem::

    invalid config: configs/x.yaml: train.lr = -1: Input should be greater than 0
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import yaml
from pydantic import BaseModel, ValidationError

from dynaresize import atomic
from dynaresize.config.base import ConfigError, RuleError  # ConfigError: imported from here by most callers
from dynaresize.config.schema import Config
from dynaresize.tasks.dataset import DatasetTask

EXTENDS_KEY = "extends"


def read_yaml_mapping(path: str | Path, what: str = "config file", mapping_of: str = "sections") -> dict[str, Any]:
    """The mapping at the top of the YAML file ``path``; an empty file is ``{}``.

    The one reader of a user's YAML file (experiment configs, ``config from-verl``'s verl config, ``simulate
    --costs``' cost file), so each fails the same way: one ConfigError naming the file and what is wrong, with the
    line and column where YAML gives them. ``what`` names the file in the cannot-read message, ``mapping_of`` what
    its top level should map."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read {what}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of {mapping_of}, got {type(data).__name__}")
    return data


def _merge(dst: dict, src: dict, source: str, prov: dict[tuple, str], prefix: tuple = ()) -> None:
    """Deep-merge ``src`` into ``dst`` (mappings merge, everything else replaces), recording provenance."""
    for key, value in src.items():
        path = prefix + (key,)
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, source, prov, path)
        else:
            dst[key] = value
            for p in [p for p in prov if p[: len(path)] == path]:
                del prov[p]
            if isinstance(value, dict):
                for sub in _leaves(value, path):
                    prov[sub] = source
            prov[path] = source


def _leaves(d: dict, prefix: tuple) -> Iterator[tuple]:
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))


def _load_layers(path: Path, prov: dict[tuple, str], seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in seen + (path,))
        raise ConfigError(f"{path}: '{EXTENDS_KEY}' forms a cycle: {chain}")
    data = read_yaml_mapping(path)
    bases = data.pop(EXTENDS_KEY, None)
    merged: dict[str, Any] = {}
    if bases is not None:
        if isinstance(bases, str):
            bases = [bases]
        if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
            raise ConfigError(f"{path}: '{EXTENDS_KEY}' = {bases!r}: allowed: a path or a list of paths (relative to this file)")
        for base in bases:
            base_path = (path.parent / base) if not Path(base).is_absolute() else Path(base)
            if not base_path.exists():
                raise ConfigError(f"{path}: '{EXTENDS_KEY}' = {base!r}: no such file {base_path}")
            _merge(merged, _load_layers(base_path, prov, seen + (path,)), str(base_path), {}, ())
            # provenance of base leaves was recorded by the recursive call
    _merge(merged, data, _display(path), prov)
    return merged


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """``'train.lr=1e-5'`` -> ``(('train', 'lr'), 1e-05)``; the value is read as a YAML scalar or flow collection."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.path=value (e.g. train.lr=1e-5)")
    key, _, raw = text.partition("=")
    parts = tuple(key.strip().split("."))
    if not key.strip() or any(not p for p in parts):
        raise ConfigError(f"override {text!r}: empty key path; expected key.path=value")
    if parts[0] == EXTENDS_KEY:
        raise ConfigError(f"override {text!r}: '{EXTENDS_KEY}' can only be set in a file")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from None
    if isinstance(value, str):  # PyYAML reads '1e-5' as a string (YAML 1.1); treat numerals as numbers
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return parts, value


def _apply_override(data: dict, parts: tuple[str, ...], value: Any, source: str, prov: dict[tuple, str]) -> None:
    node = data
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
            prov[parts[: i + 1]] = source
        elif not isinstance(nxt, dict):
            raise ConfigError(f"{source}: {'.'.join(parts[: i + 1])} = {nxt!r} is not a section, cannot set {'.'.join(parts)}")
        node = nxt
    _merge(node, {parts[-1]: value}, source, prov, parts[:-1])


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The sub-model reached by following ``loc`` through nested section fields (None where it leaves the tree)."""
    for part in loc:
        field = model.model_fields.get(str(part)) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _source_of(loc: tuple, prov: dict[tuple, str], default: str) -> str:
    for n in range(len(loc), 0, -1):
        if loc[:n] in prov:
            return prov[loc[:n]]
    return default


def _shown(value: Any, n: int = 80) -> str:
    if isinstance(value, dict):
        return "{...}"
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _format_error(err: ValidationError, prov: dict[tuple, str], default_source: str) -> str:
    """One line per problem: ``source: key.path = value: what is allowed``; a single problem is a single line."""
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        value = e.get("input")
        rule = (e.get("ctx") or {}).get("error")
        if isinstance(rule, RuleError):  # a cross-field rule: blame the key it names, not the whole section
            loc, value = loc + rule.key, rule.value
        key = ".".join(str(p) for p in loc) or "<top level>"
        source = _source_of(loc, prov, default_source)
        if e["type"] == "extra_forbidden":
            parent = _model_at(Config, loc[:-1])
            allowed = ", ".join(parent.model_fields) if parent else "?"
            shown = "" if isinstance(value, dict) else f" = {_shown(value)}"  # an unknown section: its name says it
            lines.append(f"{source}: {key}{shown}: unknown key; allowed here: {allowed}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{source}: {key} = {_shown(value)}: {msg}")
    if len(lines) == 1:
        return f"invalid config: {lines[0]}"
    head = f"invalid config ({len(lines)} problems):"
    return "\n".join([head] + ["  " + l for l in lines])


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load, layer and validate an experiment config. Raises :class:`ConfigError` with one clear message."""
    prov: dict[tuple, str] = {}
    data: dict[str, Any] = _load_layers(Path(path), prov) if path is not None else {}
    for text in overrides:
        parts, value = parse_override(text)
        _apply_override(data, parts, value, f"override '{text}'", prov)
    default_source = _display(Path(path)) if path is not None else "<defaults>"
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e, prov, default_source)) from None
    return resolve_epochs(cfg) if cfg.run.epochs is not None else cfg


def resolve_epochs(cfg: Config) -> Config:
    """``run.epochs`` turned into ``run.steps`` (the dataset's training records are read): what the run, its
    checkpoints and its resume count in. The result holds the steps and ``run.epochs: null``, so the run directory's
    config.yaml loads again as is (a resume extends it with ``run.steps=N``)."""
    task = DatasetTask(cfg.task.dataset)
    steps = task.steps_for_epochs(cfg.run.epochs, cfg.rollout.prompts_per_step)
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"steps": steps, "epochs": None})})


def dump_config(cfg: Config) -> str:
    """The fully resolved config as YAML (loadable again by :func:`load_config`)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def write_resolved(cfg: Config, run_dir: str | Path) -> Path:
    """Write the resolved config into the run directory as ``config.yaml`` (atomically) and return its path. A
    password in ``redis.url`` goes to the run's 0600 ``redis/password`` instead (config.yaml shows it redacted)."""
    from dynaresize.control.secret import keep_url_password

    keep_url_password(cfg.redis.url, run_dir)
    out = Path(run_dir) / "config.yaml"
    return atomic.write_text(out, dump_config(cfg))


def iter_fields(model: type[BaseModel] = Config, prefix: str = "") -> Iterator[tuple[str, str, Any, str | None]]:
    """Every leaf field as (dotted path, type, default, description), depth first."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from iter_fields(ann, path + ".")
            continue
        default = field.get_default(call_default_factory=True)
        tname = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
        yield path, tname, default, field.description
