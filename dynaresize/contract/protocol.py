"""What the coordinator asks of worker ranks: the payload of each command kind and the result its ack carries.

The transport is the control plane (``dynaresize.control``: durable per-rank streams, epochs, acks); this module
only fixes the *content*, as frozen pydantic models that travel as JSON. A worker validates every payload
(``parse_payload``) and answers a bad one with an error ack; it never crashes on it.

==============  =====================================================  ===============================================
kind            payload                                                ack result
==============  =====================================================  ===============================================
ping            :class:`Empty`                                         :class:`PingResult` (rank, role, version)
generate        :class:`GeneratePayload` (step, version, sampling,    :class:`GenerateResult` (samples, tokens, busy,
                prompts or the pull loop)                              prompts)
train           :class:`TrainPayload` (step, batch key, topology)      :class:`TrainResult` (loss, metrics, busy)
train_chunk     :class:`TrainChunkPayload` (step, chunk key,           :class:`TrainChunkResult` (loss sum, tokens,
                topology, version)                                     samples, busy, mismatch sums)
optimizer_step  :class:`OptimizerStepPayload` (step, topology,         :class:`OptimizerStepResult` (version, metrics,
                version after, denominator, publish)                   busy, published bytes)
sync_weights    :class:`SyncPayload` (version, topology)               :class:`SyncResult` (bytes, seconds, version)
fetch_weights   :class:`FetchWeightsPayload` (version, transport)      :class:`FetchWeightsResult` (version, started)
push_weights    :class:`PushWeightsPayload` (version, ranks)           :class:`PushWeightsResult` (version, ranks)
switch_role     :class:`SwitchPayload` (switch id, old/new trainers)  :class:`SwitchResult` (role, ops)
stage_state     :class:`StagePayload` (tag)                            :class:`StageResult` (manifests, bytes)
restore_state   :class:`StagePayload` (tag)                            :class:`RestoreResult` (version, seconds)
snapshot_held   :class:`Empty`                                         :class:`SnapshotHeldResult` (own, held)
materialize_    :class:`MaterializePayload` (tag, step, optim ranks,   :class:`StageResult` (manifests, bytes)
snapshot        weights ranks)
shutdown        :class:`Empty`                                         :class:`EmptyResult`
==============  =====================================================  ===============================================

:data:`COMMANDS` (kind -> :class:`CommandSpec`) is the one list of command kinds: :class:`CommandKind` (the kinds the
wire accepts, ``dynaresize.control.wire``) is derived from it, and every kind has a handler ``Worker._cmd_<kind>``
(``tests/unit/test_structure.py`` checks both ways). ``restore_state`` is applied by a rank to itself at start-up
(``launch.json`` names the checkpoint), never sent.

Payloads are validated strictly (no coercion: ``"3"``, ``3.0`` or ``true`` is not a step; NaN and infinities are not
sampling parameters); :func:`parse_payload` raises only :class:`PayloadError`, one line naming the field and its
value (clipped), for any input.

Roles are positional: with ``n_train`` trainers, ranks ``0..n_train-1`` train and the rest roll out (nested
prefixes, see :mod:`dynaresize.comm.groups`), so a topology is one integer on the wire.

Two ways through a step. The barrier pipeline: ``generate`` (pull loop) on the rollout ranks, one ``train`` of the
whole batch, a blocking ``sync_weights``. The barrier-free one (``dynaresize.schedule``): ``generate`` with the
prompts (GRPO groups) the scheduler assigned, ``train_chunk`` per chunk of complete groups as they arrive, one
``optimizer_step`` with the whole batch's normaliser (after which rank 0 keeps a copy of the new weights, or with
the file fallback stages them to the run's weights directory), ``fetch_weights`` to receive a version on a rollout
rank in the background into a second buffer (point to point from rank 0 over the pre-built world group once
``push_weights`` tells rank 0 to send it: sent together with the fetches of a new version, ``pushed``, so that rank 0
queues the sends before its next training command; or read from the run's weights directory); the ``generate`` that
asks for that version installs it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


MAX_PROMPTS = 4096  # prompts one generate may name


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Payload(_Msg):
    """What the coordinator sends: strict types, finite numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Empty(_Payload):
    """A command without arguments."""


class EmptyResult(_Msg):
    pass


class PingResult(_Msg):
    rank: int
    role: str
    version: int
    n_train: int


class GeneratePayload(_Payload):
    step: int = Field(ge=0, description="RL step whose batch the samples belong to")
    version: int = Field(ge=0, description="policy version the rank must hold (it refuses to generate with another)")
    pull_batch: int = Field(ge=1, description="samples claimed from the work queue at a time")
    max_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0, description="0: greedy (validation passes only; training samples need > 0)")
    top_p: float = Field(gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="the top_k most likely tokens only (-1: off)")
    validation: bool = Field(False, description="pull from the validation queue (samples scored, never trained on)")
    prompts: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=MAX_PROMPTS,
        description="generate exactly these prompts' unfinished samples (claimed at once, generated pull_batch at a "
        "time; [] generates nothing, only installs a fetched version); None: pull from the queue until it is empty",
    )

    @field_validator("prompts")
    @classmethod
    def _distinct(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and len(set(v)) != len(v):
            dup = sorted({p for p in v if v.count(p) > 1})
            raise ValueError(f"prompt(s) {dup[:5]} listed twice")
        return v


class GenerateResult(_Msg):
    samples: int
    tokens: int
    busy_s: float
    version: int
    prompts: list[int] | None = None  # the prompts asked for (generate with prompts), echoed
    install_s: float = 0.0  # installing its version before it began (waiting for the weights' read, loading them)
    # a streamed generate: the rank's decode iterations since its previous generate ack, timed (DecodeSums' keys,
    # dynaresize.contract.decode): the coordinator fits the engine's iteration cost from a batch's
    decode: dict[str, float] | None = None


WeightsTransport = Literal["comm", "file"]


class FetchWeightsPayload(_Payload):
    version: int = Field(ge=1, description="policy version to receive into a second buffer in the background")
    transport: WeightsTransport = Field(
        "file", description="comm: received from trainer rank 0 point to point over the pre-built world group (rank 0 "
        "sends once the coordinator pushes it: push_weights); file (the fallback): read from the run's weights "
        "directory (v<version>, staged by rank 0 at its optimizer step)")
    again: bool = Field(False, description="comm: receive it even if this rank installed it or a newer one (a lost "
                        "rank's groups of an older version handed to this rank)")
    keep: list[int] | None = Field(None, max_length=64, description="the versions the scheduler still counts in this "
                                   "rank's buffers: a fetched version not among them is dropped first (None: keep all)")
    pushed: bool = Field(False, description="comm: rank 0 was told to send this version to this rank already (push_weights "
                         "went with this fetch, not after its ack): the rank posts exactly one receive for it, into a "
                         "discarded buffer when it holds or is receiving the version already")
    src: int = Field(0, ge=0, description="comm: the rank that sends it: trainer rank 0, or a relay (a rollout rank that "
                     "received it; pipeline.weights_relay, planned by dynaresize/schedule/relay.py). With again and another "
                     "src than the receive under way (its relay was lost), that receive is dropped and a new one posted")
    forward: bool = Field(False, description="comm: this rank may be asked to forward the version (push_weights) once it "
                          "received it and its checksum matched")


class FetchWeightsResult(_Msg):
    version: int
    started: bool  # False: this rank already holds or is reading that version (comm: no receive posted, push nothing;
    # pushed=true: a receive into a discarded buffer was posted for the send already on its way)


class PushWeightsPayload(_Payload):
    version: int = Field(ge=1, description="policy version this rank holds and sends: rank 0 (kept at its optimizer "
                         "step), or a relay (what its fetch_weights with forward receives, sent once that is checked)")
    ranks: list[int] = Field(min_length=1, description="rollout ranks whose fetch_weights (transport comm) started a "
                             "receive of this version, or whose fetch_weights carries pushed=true (it posts one "
                             "receive whatever it holds): each gets it once, point to point")
    one_at_a_time: bool = Field(False, description="send to the ranks one after another (a relay: its first receiver "
                                "can forward soonest); false: one thread per rank (the star)")


class PushWeightsResult(_Msg):
    version: int
    ranks: list[int]  # queued: sent by rank 0's background threads while it goes on with its commands


class TrainChunkPayload(_Payload):
    step: int = Field(ge=0)
    batch_key: str = Field(description="Redis key of the chunk: a training batch (JSON) of complete GRPO groups only")
    n_train: int = Field(ge=1)
    version: int = Field(ge=0, description="policy version the batch trains from (the trainers must hold it)")
    batch_groups: int | None = Field(
        None, ge=1, description="groups the batch trains, prompts 0 .. batch_groups - 1, when known ahead (no dynamic "
        "sampling): lets each mini-batch step as soon as its groups are in (train.mini_batches > 1); None: at the end")


class TrainChunkResult(_Msg):
    loss_sum: float  # this rank's summed loss over its part of the chunk (not normalised)
    tokens: int  # response tokens of the whole chunk (every trainer's part)
    samples: int  # samples of the whole chunk
    busy_s: float
    version: int
    metrics: dict[str, float] = {}  # this rank's mismatch and TIS sums over its part (dynaresize.rl.mismatch)


class OptimizerStepPayload(_Payload):
    step: int = Field(ge=0)
    n_train: int = Field(ge=1)
    version_after: int = Field(ge=1, description="policy version once this update is applied")
    denominator: float = Field(gt=0, description="the whole batch's normaliser: its response tokens (loss_norm=token) "
                               "or samples (sequence)")
    publish: bool = Field(False, description="rank 0 publishes the new weights for the rollout ranks (transport)")
    transport: WeightsTransport = Field(
        "file", description="comm: rank 0 keeps a host copy for push_weights; file (the fallback): rank 0 stages it "
        "as <weights dir>/v<version_after>")
    keep_from: int | None = Field(None, ge=0, description="comm: the oldest version rank 0 keeps a copy of (what a "
                                  "batch in flight may still need)")


class OptimizerStepResult(_Msg):
    version: int
    metrics: dict[str, float] = {}  # grad_norm, lr; with mini-batches stepped here: their figures and loss_sum
    busy_s: float
    published_bytes: int = 0


class TrainPayload(_Payload):
    step: int = Field(ge=0)
    batch_key: str = Field(description="Redis key of the training batch (JSON, written by the coordinator)")
    n_train: int = Field(ge=1)
    version_after: int = Field(ge=1, description="policy version once this update is applied")


class TrainResult(_Msg):
    loss: float
    metrics: dict[str, float] = {}
    tokens: int
    busy_s: float
    version: int


class SyncPayload(_Payload):
    version: int = Field(ge=0)
    n_train: int = Field(ge=1)
    lost: list[int] = Field(
        default_factory=list, description="ranks declared lost: a sync group holding one is replaced by point-to-point sends"
    )


class SyncResult(_Msg):
    version: int
    bytes: int
    seconds: float


class SwitchPayload(_Payload):
    switch_id: str
    step: int = Field(ge=0)
    from_train: int = Field(ge=1)
    to_train: int = Field(ge=1)


class SwitchResult(_Msg):
    role: str
    from_role: str | None = None  # absent on ranks outside the union of old and new trainers
    ops: list[dict[str, Any]] = []


class StagePayload(_Payload):
    tag: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")


class StageResult(_Msg):
    manifest: str
    manifests: list[str]
    bytes: int
    seconds: float


class RestoreResult(_Msg):
    version: int
    seconds: float


class SnapshotHeldResult(_Msg):
    """The complete in-memory snapshots a rank holds (``dynaresize.worker.snapshot``), newest last: each ``{rank,
    step, n_train, weights}``."""

    own: list[dict[str, Any]]
    held: list[dict[str, Any]]


class MaterializePayload(_Payload):
    """Write the in-memory snapshot of ``step`` as checkpoint ``tag``: the partitions of the ``optim`` ranks (its
    own or the copy it holds), the weights files of the ``weights`` ranks."""

    tag: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")
    step: int = Field(ge=0)
    optim: list[int]
    weights: list[int]


@dataclass(frozen=True)
class CommandSpec:
    payload: type[_Payload]
    result: type[_Msg]


COMMANDS: dict[str, CommandSpec] = {
    "ping": CommandSpec(Empty, PingResult),
    "generate": CommandSpec(GeneratePayload, GenerateResult),
    "train": CommandSpec(TrainPayload, TrainResult),
    "train_chunk": CommandSpec(TrainChunkPayload, TrainChunkResult),
    "optimizer_step": CommandSpec(OptimizerStepPayload, OptimizerStepResult),
    "sync_weights": CommandSpec(SyncPayload, SyncResult),
    "fetch_weights": CommandSpec(FetchWeightsPayload, FetchWeightsResult),
    "push_weights": CommandSpec(PushWeightsPayload, PushWeightsResult),
    "switch_role": CommandSpec(SwitchPayload, SwitchResult),
    "stage_state": CommandSpec(StagePayload, StageResult),
    "restore_state": CommandSpec(StagePayload, RestoreResult),
    "snapshot_held": CommandSpec(Empty, SnapshotHeldResult),
    "materialize_snapshot": CommandSpec(MaterializePayload, StageResult),
    "shutdown": CommandSpec(Empty, EmptyResult),
}

CommandKind = enum.Enum("CommandKind", [(k.upper(), k) for k in COMMANDS], type=str, module=__name__)
CommandKind.__doc__ = "What a command asks a rank to do: one member per entry of :data:`COMMANDS`."


class PayloadError(ValueError):
    """A command payload that does not match its kind's model."""


def _shown(value: Any, n: int = 120) -> str:
    """A short repr of a rejected value (a huge or deeply nested one must not flood an ack, an event or a log)."""
    if isinstance(value, dict):
        return "{...}"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - RecursionError on a deeply nested list, a broken __repr__
        return f"<{type(value).__name__}>"
    return text if len(text) <= n else text[: n - 3] + "..."


def _name(part: object) -> str:
    text = str(part)
    return (text if text and text.isprintable() else repr(text))[:80]


def parse_payload(kind: str, payload: dict[str, Any]) -> _Payload:
    """The payload model of ``kind`` validated from ``payload``; raises :class:`PayloadError` (only) if it does not fit."""
    spec = COMMANDS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise PayloadError(f"command kind {_shown(kind)} has no payload model (kinds with one: {', '.join(COMMANDS)})")
    model = spec.payload
    try:
        return model.model_validate(payload)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        first = errs[0]
        where = ".".join(["payload", *(_name(p) for p in first["loc"])])
        more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
        if first["type"] == "missing":
            raise PayloadError(f"{kind}: {where}: missing (required)" + more) from None
        if first["type"] == "extra_forbidden":
            raise PayloadError(f"{kind}: {where} = {_shown(first.get('input'))}: unknown field; allowed: "
                               f"{', '.join(model.model_fields)}{more}") from None
        raise PayloadError(f"{kind}: {where} = {_shown(first.get('input'))}: {first['msg']}{more}") from None
    except Exception as e:  # noqa: BLE001 - a payload never takes a rank down with anything but PayloadError
        raise PayloadError(f"{kind}: payload undecodable ({e.__class__.__name__})") from None
