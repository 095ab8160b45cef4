"""Wire format of the control plane: small frozen pydantic models, JSON only, never pickle.

Every message is one JSON object stored in field ``m`` of a Redis stream entry (or hash). Decoding is strict:
unknown keys, unknown command kinds (:data:`dynaresize.contract.protocol.COMMANDS`), a newer wire version, a job id that is no job id (``keys.JOB_ID_RE``), wrong types (no coercion: ``"1"`` or ``true`` is not an
epoch), integers outside 64 bits (Redis counters are int64), non-finite timestamps, text that is not UTF-8 and
messages larger than ``redis.max_message_bytes`` raise :class:`WireError` with a one-line reason (at most
``MAX_REASON`` characters) naming the field. A rank logs the reason and skips the message; it never crashes on bad
input. NaN and infinities inside ``payload``/``result`` travel as the JSON constants ``NaN``/``Infinity`` (a NaN loss
arrives as NaN, not as ``null``).

Message kinds:

- :class:`Command` coordinator -> ranks (stream ``dr:<job>:cmd:<rank>``)
- :class:`Ack` rank -> coordinator (stream ``dr:<job>:ack:<command_id>``)
- :class:`Registration` rank -> registry (hash ``dr:<job>:rank:<rank>``)
"""

from __future__ import annotations

import enum
import time
import uuid
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dynaresize.contract.protocol import CommandKind  # the kinds: one per command of the contract
from dynaresize.contract.keys import JOB_ID_RE
from dynaresize.events import Role

WIRE_VERSION = 1
INT64_MAX = (1 << 63) - 1  # Redis integers (INCR counters: epoch, incarnation) are signed 64-bit
MAX_REASON = 500  # longest WireError reason: a reason goes into acks, events and logs

M = TypeVar("M", bound=BaseModel)


class WireError(ValueError):
    """A message that cannot be accepted; ``reason`` says why in one line."""

    def __init__(self, reason: str, raw_size: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.raw_size = raw_size


class RankState(str, enum.Enum):
    """What a rank is doing, as it reports in its registration."""

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    SWITCHING = "switching"
    STOPPING = "stopping"


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")

    v: int = Field(WIRE_VERSION, ge=1, le=WIRE_VERSION, description="wire version; a newer one is rejected")


class Command(_Wire):
    job_id: str = Field(pattern=JOB_ID_RE.pattern, description="job the command belongs to (a rank rejects another job's command)")
    epoch: int = Field(ge=1, le=INT64_MAX, description="coordinator epoch (fencing): a rank rejects epochs below the job's current one")
    command_id: str = Field(min_length=1, max_length=64, description="unique id; a retried command keeps its id and applies once")
    kind: CommandKind = Field(description="what to do")
    ranks: str = Field(description="rank-set string of all targets, e.g. '0-3,6' (informational for the receiver)")
    payload: dict[str, Any] = Field(default_factory=dict, description="kind-specific arguments (JSON values only)")
    issued_at: float = Field(default_factory=time.time, allow_inf_nan=False, description="coordinator wall time (Unix s) when first sent")
    reply_to: str | None = Field(None, min_length=1, max_length=64, description="the command whose ack (by a target "
                                 "rank) this command answers: that rank times the round trip (Ack.reply_s)")


class Ack(_Wire):
    job_id: str = Field(pattern=JOB_ID_RE.pattern, description="job of the command")
    epoch: int = Field(ge=1, le=INT64_MAX, description="epoch of the command acknowledged")
    command_id: str = Field(min_length=1, max_length=64, description="id of the command acknowledged")
    rank: int = Field(ge=0, le=INT64_MAX, description="rank answering")
    incarnation: int = Field(ge=0, le=INT64_MAX, description="incarnation of the answering rank process")
    ok: bool = Field(description="true: applied; false: rejected or failed, see error")
    result: dict[str, Any] | None = Field(None, description="what the handler returned (when ok)")
    error: str | None = Field(None, description="why it was rejected or failed (when not ok)")
    replayed: bool = Field(False, description="true when this is the stored ack of an already applied command (a retry)")
    acked_at: float = Field(default_factory=time.time, allow_inf_nan=False, description="rank wall time (Unix s)")
    reply_s: float | None = Field(None, ge=0, allow_inf_nan=False, description="seconds on this rank's clock from its "
                                  "ack of the command's reply_to to this ack, when it waited idle after that one and "
                                  "this command answers it: the control plane's round trip, the command's handling and "
                                  "its work (its result's busy_s) (None: not timed)")


class Registration(_Wire):
    job_id: str = Field(pattern=JOB_ID_RE.pattern, description="job the rank belongs to")
    rank: int = Field(ge=0, le=INT64_MAX, description="global rank")
    host: str = Field(description="host name")
    device: str = Field(description="device of the rank, e.g. 'cuda:0' or 'cpu'")
    staging_dir: str = Field(description="node-local staging directory (NVMe) of this rank")
    role: Role = Field(Role.IDLE, description="current role")
    state: RankState = Field(RankState.STARTING, description="current state")
    pid: int = Field(ge=0, le=INT64_MAX, description="process id on its host")
    incarnation: int = Field(0, ge=0, le=INT64_MAX, description="set by the registry: bumped on every (re-)register of this rank")
    launch: int = Field(0, ge=0, le=INT64_MAX, description="launch of the ranks that started this process (launch.json "
                        "'incarnation'); the registry refuses an earlier launch. 0: bound to no launch (tools, tests)")
    process: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=64,
                         description="random token of this process: a registration retried after a lost reply recognises itself")
    slurm_job_id: str | None = Field(None, description="SLURM_JOB_ID")
    het_group: int | None = Field(None, description="SLURM_HET_JOB_ID component (heterogeneous job group)")
    node: str | None = Field(None, description="SLURMD_NODENAME")
    local_id: int | None = Field(None, description="SLURM_LOCALID (rank on its node)")
    gpu: str | None = Field(None, description="CUDA_VISIBLE_DEVICES / SLURM_STEP_GPUS seen by the rank")


def new_command_id() -> str:
    return uuid.uuid4().hex


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _field_name(part: object) -> str:
    """A location part as one short printable token (a key may be empty, huge or hold control characters)."""
    text = str(part)
    if not text or not text.isprintable():
        text = repr(text)
    return _clip(text, 80)


def encode(msg: BaseModel, max_bytes: int) -> bytes:
    """JSON bytes of a message; raises :class:`WireError` when larger than ``max_bytes`` or not representable in
    JSON (a payload holding objects, bytes that are not UTF-8, a lone surrogate): never sent."""
    try:
        raw = msg.model_dump_json().encode()
    except Exception as e:  # noqa: BLE001 - PydanticSerializationError, UnicodeEncodeError, ...
        raise WireError(f"{type(msg).__name__}: not representable as JSON: {_clip(str(e), 200)}") from None
    if len(raw) > max_bytes:
        raise WireError(f"{type(msg).__name__} is {len(raw)} bytes, over max_message_bytes={max_bytes}", len(raw))
    return raw


def decode(model: type[M], raw: bytes | str | None, max_bytes: int) -> M:
    """Parse and validate one message (strictly: no type coercion); raises :class:`WireError` with a one-line
    reason naming the field, never anything else."""
    name = getattr(model, "__name__", "message")
    if raw is None:
        raise WireError(f"{name}: missing message field 'm'")
    if isinstance(raw, str):
        try:
            raw = raw.encode()
        except UnicodeEncodeError:
            raise WireError(f"{name}: <message>: text is not valid Unicode (lone surrogate)", len(raw)) from None
    if not isinstance(raw, (bytes, bytearray)):
        raise WireError(f"{name}: <message>: expected JSON bytes, got {type(raw).__name__}")
    size = len(raw)
    if size > max_bytes:
        raise WireError(f"{name}: {size} bytes, over max_message_bytes={max_bytes}", size)
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        errs = e.errors(include_url=False, include_input=False, include_context=False)
        first = errs[0] if errs else {"loc": (), "msg": str(e)}
        loc = ".".join(_field_name(p) for p in first.get("loc", ())) or "<message>"
        more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
        msg = " ".join(str(first.get("msg")).splitlines())
        raise WireError(_clip(f"{name}: {loc}: {msg}{more}", MAX_REASON), size) from None
    except Exception as e:  # noqa: BLE001 - decoding must never raise anything but WireError
        raise WireError(f"{name}: undecodable ({e.__class__.__name__})", size) from None
