"""Bad input on the wire (fault matrix row 9): hypothesis fuzzing of the control-plane parser and of command payloads,
then the same garbage pushed through a real redis-server into a real :class:`CommandReceiver`.

Properties:

- ``wire.decode`` of anything (bytes, JSON of any shape, deep nesting, huge numbers, NaN/inf, non-UTF-8, oversized,
  unknown kinds and fields, wrong types) returns a model or raises :class:`WireError`, nothing else; the reason is
  one short line and names the offending field.
- ``protocol.parse_payload`` likewise raises only :class:`PayloadError`, naming ``payload.<field>``.
- Valid messages round-trip exactly (NaN included, byte for byte).
- A receiver fed garbage interleaved with valid commands applies every valid command exactly once, in order,
  rejects each garbage entry (a ``control`` event each, an error ack where the id is readable) and never dies.
"""

from __future__ import annotations

import json
import math
import string
import tempfile
import uuid
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from dynaresize.contract.protocol import COMMANDS, CommandKind, PayloadError, parse_payload
from dynaresize.control.commands import CommandBus, CommandReceiver
from dynaresize.control.server import Endpoint, RedisServerError, connect
from dynaresize.control.wire import (
    INT64_MAX, MAX_REASON, Ack, Command, RankState, Registration, WireError, decode, encode,
)
from dynaresize.events import EventLog, Role, read_events

pytestmark = [pytest.mark.contract, pytest.mark.timeout(120)]

MAX = 1 << 20
FAST = settings(max_examples=150, deadline=None, database=None)
MODELS = (Command, Ack, Registration)

# -- strategies ------------------------------------------------------------------------------------------------
HUGE = st.sampled_from([INT64_MAX + 1, 2**64, -(2**63) - 1, 10**400, -(10**400)])
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), HUGE, FLOATS, st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                    max_leaves=12)
FINITE_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), HUGE, st.floats(allow_nan=False), st.text(max_size=12)),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=12)
I64 = st.integers(min_value=0, max_value=INT64_MAX)
JOB_IDS = st.text(alphabet=string.ascii_letters + string.digits + "._-", min_size=1, max_size=64)
TIME = st.floats(allow_nan=False, allow_infinity=False)


def commands(payload=FINITE_JSON):
    return st.builds(
        Command, job_id=JOB_IDS, epoch=st.integers(1, INT64_MAX), command_id=st.text(min_size=1, max_size=64),
        kind=st.sampled_from(CommandKind), ranks=st.text(max_size=20),
        payload=st.dictionaries(st.text(max_size=8), payload, max_size=5), issued_at=TIME)


def acks(result=FINITE_JSON):
    return st.builds(
        Ack, job_id=JOB_IDS, epoch=st.integers(1, INT64_MAX), command_id=st.text(min_size=1, max_size=64),
        rank=I64, incarnation=I64, ok=st.booleans(),
        result=st.none() | st.dictionaries(st.text(max_size=8), result, max_size=5),
        error=st.none() | st.text(max_size=40), replayed=st.booleans(), acked_at=TIME)


REGISTRATIONS = st.builds(
    Registration, job_id=JOB_IDS, rank=I64, host=st.text(max_size=20), device=st.text(max_size=10),
    staging_dir=st.text(max_size=30), role=st.sampled_from(Role), state=st.sampled_from(RankState), pid=I64,
    incarnation=I64, slurm_job_id=st.none() | st.text(max_size=10), het_group=st.none() | st.integers(),
    node=st.none() | st.text(max_size=10), local_id=st.none() | st.integers(), gpu=st.none() | st.text(max_size=10))

MESSAGES = st.one_of(commands(), acks(), REGISTRATIONS)

# Values that are wrong for a field of each kind (strict wire: no coercion, int64 bounds, finite timestamps).
NOT_STR = st.one_of(st.none(), st.booleans(), st.integers(), FLOATS, st.lists(SCALARS, max_size=2),
                    st.dictionaries(st.text(max_size=3), SCALARS, max_size=2))
NOT_INT = st.one_of(st.booleans(), FLOATS, st.text(max_size=5), st.none(), st.lists(st.integers(), max_size=2))
NEG_OR_HUGE = st.one_of(NOT_INT, st.integers(max_value=-1), st.integers(min_value=INT64_MAX + 1), HUGE)
NOT_FLOAT = st.one_of(st.booleans(), st.text(max_size=5), st.none(), st.lists(FLOATS, max_size=2),
                      st.sampled_from([math.nan, math.inf, -math.inf]))
NOT_BOOL = st.one_of(st.integers(), FLOATS, st.text(max_size=5), st.none())
NOT_JOB_ID = st.one_of(NOT_STR, st.sampled_from(["", "a:b", "x" * 65, "job a", "jöb", "j\n"]))
NOT_DICT = st.one_of(st.booleans(), st.integers(), FLOATS, st.text(max_size=5), st.lists(SCALARS, max_size=2))
WRONG: dict[type, dict[str, st.SearchStrategy]] = {
    Command: {
        "v": st.one_of(NOT_INT, st.integers().filter(lambda v: v != 1)),
        "job_id": NOT_JOB_ID, "epoch": st.one_of(NEG_OR_HUGE, st.just(0)),
        "command_id": st.one_of(NOT_STR, st.just(""), st.text(min_size=65, max_size=80)),
        "kind": st.one_of(NOT_STR, st.text(max_size=12).filter(lambda k: k not in {m.value for m in CommandKind})),
        "ranks": NOT_STR, "payload": st.one_of(NOT_DICT, st.none()), "issued_at": NOT_FLOAT,
    },
    Ack: {
        "job_id": NOT_JOB_ID, "epoch": st.one_of(NEG_OR_HUGE, st.just(0)), "command_id": NOT_STR, "rank": NEG_OR_HUGE,
        "incarnation": NEG_OR_HUGE, "ok": NOT_BOOL, "result": NOT_DICT, "replayed": NOT_BOOL, "acked_at": NOT_FLOAT,
        "error": st.one_of(st.booleans(), st.integers(), st.lists(st.text(), max_size=1)),
    },
    Registration: {
        "job_id": NOT_JOB_ID, "rank": NEG_OR_HUGE, "host": NOT_STR, "pid": NEG_OR_HUGE,
        "role": st.one_of(NOT_STR, st.text(max_size=8).filter(lambda r: r not in {m.value for m in Role})),
        "state": st.one_of(NOT_STR, st.text(max_size=8).filter(lambda r: r not in {m.value for m in RankState})),
        "het_group": st.one_of(st.booleans(), st.text(max_size=3), FLOATS), "gpu": st.one_of(st.integers(), st.booleans()),
    },
}


def valid(model: type) -> dict:
    """A valid message of ``model`` as a JSON object (always the same one: hypothesis replays examples)."""
    base = dict(job_id="job-a", epoch=3, command_id="c" * 32)
    if model is Command:
        m = Command(kind=CommandKind.TRAIN, ranks="0-3", payload={"step": 1}, issued_at=1.7e9, **base)
    elif model is Ack:
        m = Ack(rank=2, incarnation=1, ok=True, result={"loss": 0.5}, acked_at=1.7e9, **base)
    else:
        m = Registration(job_id="job-a", rank=1, host="h", device="cpu", staging_dir="/s", pid=7)
    return json.loads(m.model_dump_json())


def dumps(obj) -> bytes:
    return json.dumps(obj).encode()  # NaN/inf become the JSON constants, which the parser reads


def assert_one_line(e: WireError | PayloadError, limit: int = MAX_REASON) -> str:
    text = e.reason if isinstance(e, WireError) else str(e)
    assert "\n" not in text and text.isprintable() and 0 < len(text) <= limit, text
    return text


def try_decode(model, raw, max_bytes=MAX):
    """decode, asserting the only failure is a WireError with a one-line reason naming the model."""
    try:
        return decode(model, raw, max_bytes)
    except WireError as e:
        assert assert_one_line(e).startswith(model.__name__)
        return None


# -- the parser ------------------------------------------------------------------------------------------------
@FAST
@given(model=st.sampled_from(MODELS), raw=st.binary(max_size=600))
def test_arbitrary_bytes_decode_or_raise_wire_error(model, raw):
    try_decode(model, raw)


@FAST
@given(model=st.sampled_from(MODELS), value=JSON)
def test_json_of_any_shape_decodes_or_raises_wire_error(model, value):
    msg = try_decode(model, dumps(value))
    if msg is not None:  # the strategy can produce a valid message only by accident: then it must round-trip
        assert decode(model, encode(msg, MAX), MAX) == msg


@FAST
@given(data=st.data(), model=st.sampled_from(MODELS))
def test_a_wrong_field_is_named(data, model):
    obj = valid(model)
    field = data.draw(st.sampled_from(sorted(WRONG[model])), label="field")
    obj[field] = data.draw(WRONG[model][field], label="value")
    with pytest.raises(WireError) as e:
        decode(model, dumps(obj), MAX)
    assert assert_one_line(e.value).startswith(f"{model.__name__}: {field}"), (field, obj[field], e.value.reason)


@FAST
@given(data=st.data(), model=st.sampled_from(MODELS))
def test_unknown_and_missing_fields_are_named(data, model):
    obj = valid(model)
    if data.draw(st.booleans(), label="unknown"):
        key = data.draw(st.text(min_size=1, max_size=100).filter(lambda k: k not in model.model_fields), label="key")
        obj[key] = data.draw(JSON, label="value")
        shown = key if key.isprintable() else repr(key)
        want = f"{model.__name__}: {shown[:77]}"
    else:
        required = [n for n, f in model.model_fields.items() if f.is_required()]
        key = data.draw(st.sampled_from(required), label="missing")
        del obj[key]
        want = f"{model.__name__}: {key}: Field required"
    with pytest.raises(WireError) as e:
        decode(model, dumps(obj), MAX)
    assert assert_one_line(e.value).startswith(want)


@FAST
@given(model=st.sampled_from(MODELS), data=st.data())
def test_byte_mutations_of_a_valid_message(model, data):
    """Flipped, inserted, deleted bytes and truncation (non-UTF-8 included) never escape as anything but WireError."""
    raw = bytearray(dumps(valid(model)))
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]), label="op")
        i = data.draw(st.integers(0, max(0, len(raw) - 1)), label="at")
        if op == "flip" and raw:
            raw[i] = data.draw(st.integers(0, 255), label="byte")
        elif op == "insert":
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8), label="bytes")
        elif op == "delete" and raw:
            del raw[i]
        else:
            del raw[i:]
    try_decode(model, bytes(raw))


@settings(max_examples=80, deadline=None, database=None)
@given(msg=MESSAGES)
def test_valid_messages_round_trip(msg):
    assert decode(type(msg), encode(msg, MAX), MAX) == msg


@settings(max_examples=60, deadline=None, database=None)
@given(msg=st.one_of(commands(JSON), acks(JSON)))
def test_nan_and_infinity_survive_the_wire(msg):
    """Non-finite values inside payload/result travel as JSON constants: byte-identical after a round trip, a NaN
    loss stays NaN (not null)."""
    raw = encode(msg, MAX)
    again = decode(type(msg), raw, MAX)
    assert encode(again, MAX) == raw


def test_non_finite_timestamps_and_huge_ints_are_refused_at_both_ends():
    ok = valid(Command)
    for field, value in (("issued_at", math.nan), ("issued_at", math.inf), ("epoch", INT64_MAX + 1), ("epoch", 10**400)):
        with pytest.raises(WireError, match=f"^Command: {field}: "):
            decode(Command, dumps(ok | {field: value}), MAX)
    with pytest.raises(ValueError):  # a coordinator cannot build one either
        Command(**(ok | {"issued_at": math.inf}))
    loss = Ack(job_id="j", epoch=1, command_id="c", rank=0, incarnation=0, ok=True, result={"loss": math.nan})
    assert math.isnan(decode(Ack, encode(loss, MAX), MAX).result["loss"])


@settings(max_examples=40, deadline=None, database=None)
@given(size=st.integers(0, 3000), limit=st.integers(1024, 4096))
def test_oversized_messages_are_refused_before_parsing(size, limit):
    cmd = Command(**valid(Command) | {"payload": {"blob": "x" * size}})
    try:
        raw = encode(cmd, limit)
    except WireError as e:
        assert "max_message_bytes" in e.reason and e.raw_size > limit
        raw = cmd.model_dump_json().encode()
        with pytest.raises(WireError, match=f"over max_message_bytes={limit}"):
            decode(Command, raw, limit)
    else:
        assert len(raw) <= limit and decode(Command, raw, limit) == cmd


def test_unrepresentable_payload_is_a_wire_error_on_encode():
    for bad in ({"x": object()}, {"x": "\ud800"}, {"x": [b"\xff"]}):
        with pytest.raises(WireError, match="not representable as JSON"):
            encode(Command(**valid(Command) | {"payload": bad}), MAX)


@pytest.mark.parametrize("depth", [10, 100, 250, 5_000, 200_000])
@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
def test_deep_nesting(depth, opener):
    """Top level and inside the payload: accepted within the parser's depth limit, a WireError beyond, never a crash."""
    closer = b"]" if opener == b"[" else b"}"
    nest = opener * depth + b"1" + closer * depth
    try_decode(Command, nest)
    head = dumps(valid(Command) | {"payload": {}})
    inside = head.replace(b'"payload": {}', b'"payload": {"deep": ' + nest + b"}")
    msg = try_decode(Command, inside)
    assert (msg is not None) == (depth <= 100), "the JSON parser's depth limit is about 200"


def test_non_utf8_and_surrogates():
    good = dumps(valid(Command))
    for raw in (good.replace(b"job-a", b"job-\xff"), good.replace(b"job-a", b"\xed\xa0\x80"), b"\xff\xfe\x00",
                good.decode().replace("job-a", "\ud800"), good.replace(b"job-a", b"\\ud800")):
        with pytest.raises(WireError):
            decode(Command, raw, MAX)
    for raw in (7, 1.5, [good], {"m": good}):
        with pytest.raises(WireError, match="expected JSON bytes"):
            decode(Command, raw, MAX)


# -- payloads --------------------------------------------------------------------------------------------------
VALID_PAYLOADS = {
    "generate": dict(step=3, version=2, pull_batch=8, max_tokens=16, temperature=1.0, top_p=0.9, prompts=[4, 0, 9]),
    "train": dict(step=3, batch_key="dr:j:batch:3", n_train=2, version_after=4),
    "train_chunk": dict(step=3, batch_key="dr:j:chunk:3:0", n_train=2, version=3),
    "optimizer_step": dict(step=3, n_train=2, version_after=4, denominator=517.0, publish=True),
    "sync_weights": dict(version=4, n_train=2, lost=[3]),
    "fetch_weights": dict(version=4),
    "push_weights": dict(version=4, ranks=[2, 3]),
    "switch_role": dict(switch_id="s1", step=3, from_train=2, to_train=3),
    "stage_state": dict(tag="step-3_a.b"),
    "restore_state": dict(tag="step-3_a.b"),
    "snapshot_held": {},
    "materialize_snapshot": dict(tag="step-3.2", step=3, optim=[0, 1], weights=[0, 1, 2]),
    "ping": {},
    "shutdown": {},
}
WITH_FIELDS = sorted(k for k, v in VALID_PAYLOADS.items() if v)
PAYLOAD_WRONG = st.one_of(NOT_STR, NOT_INT, st.integers(max_value=-1), st.sampled_from([math.nan, math.inf, -math.inf]))


def test_every_payload_kind_has_a_valid_example():
    assert sorted(VALID_PAYLOADS) == sorted(COMMANDS)


@FAST
@given(kind=st.sampled_from(sorted(COMMANDS)), payload=JSON)
def test_payload_of_any_shape_parses_or_raises_payload_error(kind, payload):
    try:
        parse_payload(kind, payload)
    except PayloadError as e:
        assert assert_one_line(e, 400).startswith(f"{kind}: payload")


@FAST
@given(data=st.data(), kind=st.sampled_from(WITH_FIELDS))
def test_a_wrong_payload_field_is_named(data, kind):
    payload = dict(VALID_PAYLOADS[kind])
    field = data.draw(st.sampled_from(sorted(payload)), label="field")
    value = data.draw(PAYLOAD_WRONG, label="value")
    payload[field] = value
    try:
        model = parse_payload(kind, payload)
    except PayloadError as e:
        assert assert_one_line(e, 400).startswith(f"{kind}: payload.{field}"), str(e)
    else:  # the drawn value happened to be valid for that field: it must be kept exactly (a JSON integer given
        # for a float field is that float: JSON has one number type)
        got = model.model_dump()[field]
        want_type = float if isinstance(got, float) and type(value) is int else type(value)
        assert got == value and type(got) is want_type, (field, value)


@FAST
@given(data=st.data(), kind=st.sampled_from(sorted(COMMANDS)))
def test_unknown_and_missing_payload_fields_are_named(data, kind):
    payload = dict(VALID_PAYLOADS[kind])
    required = [n for n, f in COMMANDS[kind].payload.model_fields.items() if f.is_required()]
    if not required or data.draw(st.booleans(), label="unknown"):
        key = data.draw(st.text(min_size=1, max_size=20).filter(lambda k: k not in payload), label="key")
        payload[key] = data.draw(JSON, label="value")
        want = f"{kind}: payload.{key if key.isprintable() else repr(key)}"
    else:
        key = data.draw(st.sampled_from(required), label="missing")
        del payload[key]
        want = f"{kind}: payload.{key}: missing"
    with pytest.raises(PayloadError) as e:
        parse_payload(kind, payload)
    assert assert_one_line(e.value, 400).startswith(want[:60])


@pytest.mark.parametrize("kind", sorted(VALID_PAYLOADS))
def test_valid_payloads_round_trip_through_the_wire(kind):
    cmd = Command(**valid(Command) | {"kind": kind, "payload": VALID_PAYLOADS[kind]})
    got = parse_payload(kind, decode(Command, encode(cmd, MAX), MAX).payload)
    assert got.model_dump(exclude_unset=True) == VALID_PAYLOADS[kind]


def test_payload_edge_cases_are_payload_errors():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    cases = [("generate", deep), ("generate", {"step": deep}), ("train", {"batch_key": "k" * 1_000_000}),
             ("teleport", {}), (["generate"], {}), (None, {}), ("ping", {"rank": 0}), ("generate", None),
             ("generate", {**VALID_PAYLOADS["generate"], "step": "3"}), ("generate", {**VALID_PAYLOADS["generate"], "step": True}),
             ("generate", {**VALID_PAYLOADS["generate"], "temperature": math.inf})]
    for kind, payload in cases:
        with pytest.raises(PayloadError) as e:
            parse_payload(kind, payload)
        assert_one_line(e.value, 400)


@pytest.mark.parametrize("kind,field,value,why", [
    ("generate", "prompts", [3, -1], "payload.prompts.1 = -1: Input should be greater than or equal to 0"),
    ("generate", "prompts", [3, "4"], "payload.prompts.1 = '4': Input should be a valid integer"),
    ("generate", "prompts", [2, 5, 2], "payload.prompts = [2, 5, 2]: Value error, prompt(s) [2] listed twice"),
    ("generate", "prompts", list(range(4097)), "List should have at most 4096 items"),
    ("train_chunk", "version", -1, "payload.version = -1: Input should be greater than or equal to 0"),
    ("train_chunk", "n_train", 0, "payload.n_train = 0: Input should be greater than or equal to 1"),
    ("train_chunk", "batch_key", 7, "payload.batch_key = 7: Input should be a valid string"),
    ("optimizer_step", "denominator", 0.0, "payload.denominator = 0.0: Input should be greater than 0"),
    ("optimizer_step", "denominator", math.nan, "payload.denominator = nan: Input should be a finite number"),
    ("optimizer_step", "denominator", "12", "payload.denominator = '12': Input should be a valid number"),
    ("optimizer_step", "publish", 1, "payload.publish = 1: Input should be a valid boolean"),
    ("optimizer_step", "version_after", 0, "payload.version_after = 0: Input should be greater than or equal to 1"),
    ("fetch_weights", "version", 0, "payload.version = 0: Input should be greater than or equal to 1"),
    ("fetch_weights", "version", 2.0, "payload.version = 2.0: Input should be a valid integer"),
])
def test_the_streaming_payloads_name_a_bad_field(kind, field, value, why):
    with pytest.raises(PayloadError) as e:
        parse_payload(kind, {**VALID_PAYLOADS[kind], field: value})
    assert why in assert_one_line(e.value, 400)
    assert parse_payload("generate", {**VALID_PAYLOADS["generate"], "prompts": None}).prompts is None  # the pull loop


# -- end to end: garbage in a rank's command stream -----------------------------------------------------------
# A plan is a list of steps: ("valid", kind) sends a real command through CommandBus; ("drain",) lets the rank
# process what is there; anything else is garbage XADDed straight into the rank's stream. Every valid command is
# preceded by garbage, a drain or nothing, and garbage may trail the last one.
GARBAGE = st.one_of(
    st.tuples(st.just("bytes"), st.binary(max_size=200)),
    st.tuples(st.just("json"), JSON),
    st.tuples(st.just("wrong_field"), st.sampled_from(sorted(set(WRONG[Command]) - {"command_id"})), st.data()),
    st.tuples(st.just("unknown_field"), st.text(alphabet=string.ascii_letters, min_size=1, max_size=10), JSON),
    st.tuples(st.just("unknown_kind"), st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=10)),
    st.tuples(st.just("stale_epoch")),
    st.tuples(st.just("other_job")),
    st.tuples(st.just("oversized")),
    st.tuples(st.just("no_m_field")),
)
PLAN = st.builds(
    lambda pairs, tail: [s for before, kind in pairs for s in ([before] if before else []) + [("valid", kind)]] + tail,
    st.lists(st.tuples(st.one_of(st.none(), st.tuples(st.just("drain")), GARBAGE, GARBAGE), st.sampled_from(CommandKind)),
             min_size=1, max_size=8),
    st.lists(GARBAGE, max_size=3))


@pytest.fixture
def redis_endpoint(redis_server):
    return redis_server.endpoint_file


OPTIONAL_ACK = "optional"


def _garbage_entry(step, cmd: Command, cfg) -> tuple[dict, str | None, bool | str]:
    """(stream fields, the command id a receiver can read from it or None, whether an error ack must follow)."""
    what = step[0]
    base = json.loads(cmd.model_dump_json())
    if what == "bytes":
        return {"m": step[1]}, None, False
    if what == "json":
        return {"m": dumps(step[1])}, None, False
    if what == "wrong_field":
        field, data = step[1], step[2]
        return {"m": dumps(base | {field: data.draw(WRONG[Command][field], label=f"bad {field}")})}, cmd.command_id, True
    if what == "unknown_field":
        assume(step[1] not in Command.model_fields)
        return {"m": dumps(base | {step[1]: step[2]})}, cmd.command_id, True
    if what == "unknown_kind":
        assume(step[1] not in {k.value for k in CommandKind})
        return {"m": dumps(base | {"kind": step[1]})}, cmd.command_id, True
    if what == "stale_epoch":
        return {"m": dumps(base | {"epoch": cmd.epoch - 1})}, cmd.command_id, True
    if what == "other_job":
        return {"m": dumps(base | {"job_id": "someone-else"})}, cmd.command_id, True
    if what == "oversized":
        return {"m": dumps(base | {"payload": {"blob": "x" * cfg.max_message_bytes}})}, None, False
    return {"not_m": b"1"}, None, False


@settings(max_examples=20, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(plan=PLAN)
def test_receiver_applies_every_valid_command_once_in_order_and_rejects_the_garbage(redis_endpoint, cfg, plan):
    job = f"fuzz-{uuid.uuid4().hex[:10]}"
    made: list[redis.Redis] = []

    def client(role):
        made.append(connect(redis_endpoint, role=role, cfg=cfg))
        return made[-1]

    with tempfile.TemporaryDirectory(prefix="fuzz-events-") as tmp:
        events = EventLog(Path(tmp) / "events.jsonl")
        try:
            CommandBus(client("coord-old"), job, cfg)  # epoch 1: a predecessor, so a stale epoch exists
            bus = CommandBus(client("coord"), job, cfg)
            raw = client("garbage")
            recv = CommandReceiver(client("rank0"), job, 0, cfg, events=events)
            applied: list[str] = []

            def handler(c: Command):
                applied.append(c.command_id)
                return {"kind": c.kind.value}

            sent, garbage = [], []  # garbage: (command id readable from it or None, error ack expected)
            for step in plan:
                if step[0] == "valid":
                    sent.append(bus.send(step[1], [0], {"i": len(sent)}))
                elif step[0] == "drain":
                    recv.process(handler)
                else:
                    fields, cid, must_ack = _garbage_entry(step, bus.command(CommandKind.PING, [0]), cfg)
                    raw.xadd(f"dr:{job}:cmd:0", fields)
                    garbage.append((cid, must_ack))
            while recv.process(handler):
                pass

            assert applied == [c.command_id for c in sent], "every valid command exactly once, in order"
            assert recv.rejected == len(garbage)
            assert recv.process(handler) == 0 and CommandReceiver(client("rank0-again"), job, 0, cfg, wake=False).process(handler) == 0
            assert applied == [c.command_id for c in sent], "nothing applied again after a restart"
            for c in sent:
                res = bus.await_acks(c.command_id, [0], 1.0)
                assert res.missing == [] and res.acks[0].ok and res.acks[0].result == {"kind": c.kind.value}
            rejected = [e for e in read_events(Path(tmp) / "events.jsonl") if e["what"] == "rejected"]
            assert len(rejected) == len(garbage) and all(e["rank"] == 0 and e["reason"] for e in rejected)
            for ev, (cid, must_ack) in zip(rejected, garbage):
                assert ev.get("command_id") == cid or (must_ack == OPTIONAL_ACK and ev.get("command_id") is None)
            for cid, must_ack in garbage:
                entries = raw.xrange(f"dr:{job}:ack:{cid}") if cid else []
                if must_ack == OPTIONAL_ACK and not entries:
                    continue
                assert len(entries) == (1 if must_ack else 0), f"one error ack for readable garbage {cid}"
                if not entries:
                    continue
                ack = decode(Ack, entries[0][1][b"m"], MAX)
                assert not ack.ok and ack.rank == 0 and ack.error.startswith("rejected: ")
        finally:
            for c in made:
                c.close()


# -- rejections that need the receiver to know the command's job and the job's epoch --------------------------
def _push(client, job, fields):
    client.xadd(f"dr:{job}:cmd:0", fields)


def _run(client, cfg, job, events=None):
    recv = CommandReceiver(client("rank"), job, 0, cfg, events=events, wake=False)
    applied = []
    while recv.process(lambda c: applied.append(c.command_id)):
        pass
    return recv, applied


def _control(path):
    return [e for e in read_events(path) if e.type.value == "control"]


def test_stale_epoch_is_rejected_with_an_error_ack_and_a_control_event(client, cfg, job_id, tmp_path):
    old = CommandBus(client("old"), job_id, cfg)
    new = CommandBus(client("new"), job_id, cfg)
    stale = old.command(CommandKind.TRAIN, [0])
    _push(client(), job_id, {"m": encode(stale, MAX)})  # what the fenced coordinator still had in flight
    fresh = new.send(CommandKind.TRAIN, [0])
    recv, applied = _run(client, cfg, job_id, EventLog(tmp_path / "ev.jsonl"))
    assert applied == [fresh.command_id] and recv.rejected == 1
    ack = decode(Ack, client().xrange(f"dr:{job_id}:ack:{stale.command_id}")[0][1][b"m"], MAX)
    assert not ack.ok and ack.epoch == old.epoch and "stale epoch 1 < 2" in ack.error
    [ev] = _control(tmp_path / "ev.jsonl")
    assert ev["command_id"] == stale.command_id and ev["epoch"] == old.epoch and "stale epoch" in ev["reason"]


def test_another_jobs_command_is_rejected_with_an_error_ack_and_a_control_event(client, cfg, job_id, tmp_path):
    bus = CommandBus(client("coord"), job_id, cfg)
    foreign = bus.command(CommandKind.SWITCH_ROLE, [0]).model_copy(update={"job_id": "other-job"})
    _push(client(), job_id, {"m": encode(foreign, MAX)})
    after = bus.send(CommandKind.PING, [0])
    recv, applied = _run(client, cfg, job_id, EventLog(tmp_path / "ev.jsonl"))
    assert applied == [after.command_id] and recv.rejected == 1
    [ev] = _control(tmp_path / "ev.jsonl")
    assert "other-job" in ev["reason"] and ev["rank"] == 0
    assert ev.get("command_id") == foreign.command_id
    ack = bus.await_acks(foreign.command_id, [0], 1.0).acks[0]
    assert not ack.ok and "other-job" in ack.error


def test_a_command_from_a_future_epoch_is_rejected_and_does_not_fence_the_coordinator(client, cfg, job_id, tmp_path):
    bus = CommandBus(client("coord"), job_id, cfg)
    forged = bus.command(CommandKind.SHUTDOWN, [0]).model_copy(update={"epoch": bus.epoch + 1000})
    _push(client(), job_id, {"m": encode(forged, MAX)})
    after = bus.send(CommandKind.PING, [0])
    recv, applied = _run(client, cfg, job_id, EventLog(tmp_path / "ev.jsonl"))
    assert applied == [after.command_id], "the forged command must not run, the real one must"
    assert recv.rejected == 1 and bus.await_acks(after.command_id, [0], 1.0).acks[0].ok


def test_deeply_nested_garbage_does_not_kill_the_receiver(client, cfg, job_id):
    bus = CommandBus(client("coord"), job_id, cfg)
    _push(client(), job_id, {"m": b"[" * 100_000})
    _push(client(), job_id, {"m": b'{"command_id": "deep1", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"})
    after = bus.send(CommandKind.PING, [0])
    recv, applied = _run(client, cfg, job_id)
    assert applied == [after.command_id] and recv.rejected == 2


# -- password --------------------------------------------------------------------------------------------------
def test_clients_without_or_with_a_wrong_password_are_refused(redis_server, cfg, job_id, tmp_path):
    ep = Endpoint.load(redis_server.endpoint_file)
    # no password (what a rank gets from an endpoint file without password_file): redis-py's RESP3 handshake is
    # answered "HELLO must be called with the client already authenticated ..." (RESP2: "NOAUTH Authentication
    # required"); refused at once, not retried (SafeRetry)
    no_password = connect(f"redis://{ep.host}:{ep.port}/0", role="no-password", cfg=cfg)
    with pytest.raises(redis.AuthenticationError, match="(?i)authenticat"):
        no_password.ping()
    wrong = connect(f"redis://:not-it@{ep.host}:{ep.port}/0", role="intruder", cfg=cfg)
    with pytest.raises(redis.AuthenticationError, match="(?i)invalid username-password|WRONGPASS|invalid password"):
        wrong.ping()
    # a rank whose endpoint file points at a stale password file (another run's) is refused as well, and can
    # neither read nor write the job's keys
    (tmp_path / "password").write_text("stale-password\n")
    (tmp_path / "redis.json").write_text(json.dumps({"host": ep.host, "port": ep.port, "password_file": "password"}))
    stale = connect(tmp_path / "redis.json", role="stale", cfg=cfg)
    with pytest.raises(redis.AuthenticationError):
        CommandReceiver(stale, job_id, 0, cfg, wake=False)
    with pytest.raises(redis.AuthenticationError):
        stale.xadd(f"dr:{job_id}:cmd:0", {"m": b"{}"})
    assert redis_server.client().exists(f"dr:{job_id}:cmd:0") == 0
    (tmp_path / "gone.json").write_text(json.dumps({"host": ep.host, "port": ep.port, "password_file": "missing"}))
    with pytest.raises(RedisServerError, match="cannot read the Redis password file"):
        connect(tmp_path / "gone.json", role="lost", cfg=cfg)
    for c in (no_password, wrong, stale):
        c.close()
