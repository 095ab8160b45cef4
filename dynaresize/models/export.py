"""``dynaresize export RUN_DIR [--step N] -o DIR``: a run's checkpoint as a Hugging Face model directory.

What a checkpoint holds (``dynaresize.job.checkpoint_files``): per rank, ``rank<r>-weights`` (the module's named
parameters in the model's dtype: what rollout served at that version) and, on the trainers ``0..n_train-1``,
``rank<r>-optim`` (their ZeRO partitions: fp32 master and Adam moments of each parameter group, in the global
coordinates of ``dynaresize.engines.trainer_deepspeed.PartitionLayout``). The export takes the **fp32 masters** (the
trainer's own weights, full precision), concatenates the trainers' partitions in ``dp_rank`` order, cuts DeepSpeed's
tail padding off and unflattens the vector into the named parameters in ``named_parameters()`` order (the order
DeepSpeed flattened them, read from the weights snapshot's manifest), then casts to the output dtype (default: the
run's model dtype). Before writing, every cast tensor is compared with rank 0's staged weights of the same version
when the dtypes agree: they must be equal bit for bit (the trainer copies its masters into the module after each
step), so the directory is exactly the policy the run held, and a layout this reader got wrong cannot go unnoticed.

The directory: ``model.safetensors`` (HF names; tied embeddings stay tied: the trainer's module has one tensor for
both, ``config.json`` says ``tie_word_embeddings``), the run's model directory's other files (``config.json`` with
the output dtype, tokenizer files and chat template, ``generation_config.json``: written from the config when the
source has none; a license or README travels with them) and ``dynaresize_export.json`` (run, tag, step, version,
dtype; ``run_config.yaml`` beside it, the run's resolved config, is what ``dynaresize eval`` reads its reward and
sampling settings from). Written into a temporary sibling and renamed into place: never half a directory.

Memory: about 8 bytes a parameter at the peak (the fp32 partitions and their concatenation; then the vector and the
cast copies), plus rank 0's weights for the check: one host's memory must hold the model about three times in fp32.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dynaresize.config.loader import ConfigError

log = logging.getLogger(__name__)

EXPORT_FILE = "dynaresize_export.json"
RUN_CONFIG = "run_config.yaml"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# files of a model directory that are weights (replaced by the export's own) or the tiny build's record (not ours)
_SKIP = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".index.json")
_SKIP_NAMES = ("dynaresize_model.json", EXPORT_FILE, RUN_CONFIG)


class ExportError(ConfigError):
    """A run directory or checkpoint that cannot be exported; the message names the path and what is wrong."""


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint of a run: ``checkpoints/<tag>``, taken when ``step`` was the next step to train,
    holding policy ``version`` on ``n_train`` trainers."""

    run_dir: Path
    tag: str
    step: int
    version: int
    n_train: int

    @property
    def path(self) -> Path:
        return self.run_dir / "checkpoints" / self.tag


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The run's complete checkpoints, newest step first (one per step: its newest complete attempt)."""
    from dynaresize.job import checkpoint_files as ckpt
    from dynaresize.job.state import STATE_FILE, StateError, read_state

    try:
        top = read_state(run_dir / "checkpoints" / STATE_FILE)
    except StateError:
        top = None
    out: dict[int, Checkpoint] = {}
    for tag in ckpt.tags(run_dir):
        step = ckpt.tag_step(tag)
        if step in out:
            continue
        try:
            st = read_state(run_dir / "checkpoints" / tag / STATE_FILE)
        except StateError:
            if top is None or top.checkpoint != f"checkpoints/{tag}":  # an older layout: only the top file says so
                continue
            st = top
        out[step] = Checkpoint(run_dir, tag, step, st.version, st.n_train)
    return sorted(out.values(), key=lambda c: -c.step)


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Checkpoint:
    """The run's last complete checkpoint, or the one of ``step``; :class:`ExportError` naming what there is."""
    from dynaresize.rundir import RunDirError, require_run_dir

    try:
        run_dir = require_run_dir(run_dir).resolve()
    except RunDirError as e:
        raise ExportError(str(e)) from None
    found = complete_checkpoints(run_dir)
    if not found:
        raise ExportError(f"{run_dir}: no complete checkpoint under {run_dir / 'checkpoints'} (a run checkpoints "
                          "every run.checkpoint_every steps and at its end; one cut short has no coordinator.json)")
    if step is None:
        return found[0]
    for c in found:
        if c.step == step:
            return c
    raise ExportError(f"{run_dir}: no checkpoint of step {step}; the run has steps "
                      f"{', '.join(str(c.step) for c in reversed(found))}")


def source_model_dir(run_dir: Path, cfg) -> Path:
    """The model directory the run's ranks loaded (``launch.json``), else the run config's (``model.path``, or the
    tiny model's cache, built again if it is gone)."""
    from dynaresize.models.hf import ModelDirError, check_model_dir

    try:
        launched = json.loads((run_dir / "launch.json").read_text())["model_dir"]
        return check_model_dir(launched, what=f"{run_dir / 'launch.json'}: model_dir")
    except (OSError, ValueError, KeyError, TypeError, ModelDirError) as e:
        log.info("the run's launched model directory is not usable (%s): using the run config's", e)
    from dynaresize.models.store import ensure_model

    return ensure_model(cfg)


def _stager(root: Path):
    from dynaresize.staging import Stager

    return Stager(root, buffer_mb=1, chunk_mb=1, writer_threads=1)  # reads only: one small pool buffer


def master_weights(ck: Checkpoint) -> tuple[dict[str, torch.Tensor], str]:
    """The trainers' fp32 masters of checkpoint ``ck`` as named parameters, and the dtype rank 0's weights have."""
    from dynaresize.staging import StagingError, read_manifest

    try:
        entries = read_manifest(ck.path / "rank0-weights")["tensors"]
        groups: dict[int, dict[int, torch.Tensor]] = {}
        layouts: dict[int, dict] = {}
        for r in range(ck.n_train):
            snap = ck.path / f"rank{r}-optim"
            parts = read_manifest(snap)["meta"]["partitions"]
            tensors, _ = _stager(ck.path).load(snap, names={f"g{p['group']}.master" for p in parts})
            for p in parts:
                g = p["group"]
                if p["dp"] != ck.n_train or groups.setdefault(g, {}).get(p["dp_rank"]) is not None:
                    raise ExportError(f"{snap}: partition {p} does not fit {ck.n_train} trainers")
                groups[g][p["dp_rank"]] = tensors[f"g{g}.master"]
                layouts[g] = p
    except StagingError as e:
        raise ExportError(f"checkpoint {ck.path}: {e}") from None
    if sorted(groups) != [0]:
        raise ExportError(f"checkpoint {ck.path}: the trainer had parameter groups {sorted(groups)}; the export reads "
                          "one (the trainer builds one from module.parameters())")
    length = int(layouts[0]["length"])
    if sorted(groups[0]) != list(range(ck.n_train)):
        raise ExportError(f"checkpoint {ck.path}: partitions of dp ranks {sorted(groups[0])}, expected 0..{ck.n_train - 1}")
    parts, groups, tensors = groups[0], None, None  # the partitions go once concatenated
    flat = torch.cat([parts.pop(d) for d in range(ck.n_train)])[:length]
    numel = [int(torch.Size(e["shape"]).numel()) for e in entries]
    if sum(numel) != length:  # DeepSpeed's zero_optimization.parameter_alignment (off here) would leave gaps
        raise ExportError(f"checkpoint {ck.path}: the masters hold {length} values, the {len(entries)} parameters of "
                          f"rank0-weights {sum(numel)}: a flat layout this export does not know")
    out, pos = {}, 0
    for e, n in zip(entries, numel):
        out[e["name"]] = flat[pos:pos + n].view(e["shape"])  # views of the vector (the cast copies them)
        pos += n
    return out, entries[0]["dtype"]


def _check_against_weights(ck: Checkpoint, tensors: dict[str, torch.Tensor]) -> int:
    """Each exported tensor equals rank 0's staged weight of the same version, bit for bit (those of another dtype
    than the output's are compared after the same cast). Returns how many were compared."""
    from dynaresize.staging import StagingError

    try:
        staged, _ = _stager(ck.path).load(ck.path / "rank0-weights")
    except StagingError as e:
        raise ExportError(f"checkpoint {ck.path}: {e}") from None
    for name, w in staged.items():
        t = tensors[name]
        if not torch.equal(t, w.to(t.dtype)) and not torch.equal(t.to(w.dtype), w):
            diff = (t.float() - w.float()).abs().max().item()
            raise ExportError(f"checkpoint {ck.path}: parameter {name!r} from the fp32 masters differs from rank 0's "
                              f"staged weights by up to {diff:.3g}; the checkpoint is inconsistent, not exported")
    return len(staged)


def _generation_config(config: dict) -> dict:
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    return {**gen, "_from_model_config": True}


def export(run_dir: str | Path, out: str | Path, step: int | None = None, dtype: str = "auto") -> dict:
    """Write checkpoint ``step`` (default: the last) of ``run_dir`` as an HF model directory ``out`` (absent or
    empty). Returns the record written to ``dynaresize_export.json``."""
    from safetensors.torch import save_file

    from dynaresize.config.loader import load_config

    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: exists and is not an empty directory; the export writes a new one (choose another "
                          "-o, or remove it)")
    ck = find_checkpoint(run_dir, step)
    cfg = load_config(ck.run_dir / "config.yaml")
    src = source_model_dir(ck.run_dir, cfg)
    tensors, run_dtype = master_weights(ck)
    name = run_dtype if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ExportError(f"--dtype {dtype}: expected auto or one of {', '.join(DTYPES)}")
    tensors = {n: t.to(DTYPES[name], copy=True) for n, t in tensors.items()}  # own storage each (safetensors)
    checked = _check_against_weights(ck, tensors)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for f in sorted(src.iterdir()):
            if f.is_file() and not f.name.endswith(_SKIP) and f.name not in _SKIP_NAMES and not f.name.startswith("."):
                shutil.copy2(f, tmp / f.name)
        config = json.loads((src / "config.json").read_text())
        config["dtype"] = config["torch_dtype"] = name  # transformers 5 reads dtype, 4.x (verl's) torch_dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if not (tmp / "generation_config.json").exists():
            (tmp / "generation_config.json").write_text(json.dumps(_generation_config(config), indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy2(ck.run_dir / "config.yaml", tmp / RUN_CONFIG)
        record = {"run_dir": str(ck.run_dir.resolve()), "tag": ck.tag, "step": ck.step, "version": ck.version,
                  "n_train": ck.n_train, "dtype": name, "source_model_dir": str(src), "parameters": len(tensors),
                  "numel": sum(t.numel() for t in tensors.values()), "checked_against_rank0_weights": checked}
        (tmp / EXPORT_FILE).write_text(json.dumps(record, indent=1) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


# -- the command -------------------------------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (dynaresize run's output)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the last one)")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="the model directory to write (absent or empty)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="dtype of the weights written (auto: the run's model dtype; float32: the fp32 masters as they are)")


def main(args) -> int:
    rec = export(args.run_dir, args.out, args.step, args.dtype)
    print(f"exported {rec['tag']} of {rec['run_dir']} (policy version {rec['version']}, {rec['numel']:,} parameters, "
          f"{rec['dtype']}) to {args.out}")
    print(json.dumps({"out": str(Path(args.out).resolve()), **rec}, separators=(",", ":")))
    return 0
