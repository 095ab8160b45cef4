"""The rollout work queue: prompts are pulled by rollout ranks, so one long response never holds a whole shard.

Why it exists: with a static shard per rank, the slowest shard sets the rollout time; with pulls, a rank that
finishes early takes more work. It is also what makes a resize in the middle of a rollout safe: a rank that leaves
the rollout role (or dies) has its claimed-but-unfinished samples put back, and results are keyed by sample, so
nothing is dropped and nothing is counted twice.

Keys (under the job's namespace ``dr:<job>``; one set per RL step)::

    dr:<job>:wq:<step>:pending         list   work items not yet claimed (JSON)
    dr:<job>:wq:<step>:inflight:<r>    hash   sample key -> item, claimed by rank r and not yet finished
    dr:<job>:wq:<step>:results         hash   sample key -> result JSON (HSETNX: the first result wins)
    dr:<job>:wq:<step>:meta            hash   total (items published), round:<r> (items of extra round r)
    dr:<job>:wq:<step>:lastclaim:<r>   string "<claim token>|<key>,<key>,..": rank r's last claim (see below)

A validation pass uses the same layout under ``dr:<job>:vq:<version>:...`` (``RolloutQueue(..., name="vq")``).

Lifecycle of one sample (step, prompt, index), all transitions atomic (Lua)::

    PENDING --claim(r)--> INFLIGHT(r) --complete--> DONE
                 ^                |
                 +---release(r)---+      (rank r leaves the rollout role, or is declared dead)

``claim`` takes the next ``n`` items in queue order (the pull loop); ``claim_prompts`` takes every unfinished item of
the named prompts (a scheduler that assigns whole GRPO groups to ranks). Both end in the same in-flight hash, so
``complete`` and ``release`` treat their items alike.

A rank the coordinator declared lost (``Registry.fence``) is refused: its claims get nothing and its results
raise :class:`FencedRankError`, so a process that was only hung (SIGSTOP) and comes back cannot write into a
step that its released samples were already given to others for.

A sample is seeded by (seed, step, prompt, index), so whichever rank generates it, the tokens are the same; a
late duplicate from a released-but-alive rank is therefore identical and is dropped by HSETNX.

Redis restarts and retries: redis-py sends a command again after a connection error; when Redis was killed after
it applied (and logged) a script but before the reply went out, the retry applies it a second time. Every call here
is safe under that: ``publish`` is one script (meta and items together, at most once), ``complete`` and ``release``
are idempotent, and ``claim`` (like ``claim_prompts``) carries a token (one per call, the same on redis-py's
retries): a claim whose token is the rank's last claim returns that claim's unfinished items again instead of taking
new ones, so items taken by a claim whose reply was lost are not stranded in the rank's in-flight hash.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

import redis

from dynaresize.contract.keys import Keys
from dynaresize.contract.fencing import FencedRankError

_PUBLISH = """
if redis.call('HSETNX', KEYS[1], 'total', ARGV[1]) == 0 then return 0 end
for i = 2, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
return #ARGV - 1
"""
_EXTEND = """
if redis.call('HEXISTS', KEYS[1], 'total') == 0 then return -1 end
if redis.call('HSETNX', KEYS[1], 'round:' .. ARGV[1], #ARGV - 1) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'total', #ARGV - 1)
for i = 2, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
return #ARGV - 1
"""
# Both claims start alike: a fenced rank gets nothing, and a claim whose token is the rank's last claim (its reply
# was lost, redis-py sent it again) returns that claim's unfinished items instead of taking new ones. $RANK and
# $TOKEN name the ARGV slots of the rank and the token; each claim ends by recording its token and keys.
_FENCED_OR_REPLAYED = """
if redis.call('SISMEMBER', KEYS[4], $RANK) == 1 then return false end
local out = {}
local last = redis.call('GET', KEYS[5])
if last then
  local tok, ks = string.match(last, '^([^|]*)|(.*)$')
  if tok == $TOKEN then  -- this very claim, applied before (its reply was lost): the same items again
    for k in string.gmatch(ks, '[^,]+') do
      local it = redis.call('HGET', KEYS[2], k)
      if it then out[#out + 1] = it end
    end
    return out
  end
end
"""


def _claim_script(rank: str, token: str, body: str) -> str:
    head = _FENCED_OR_REPLAYED.replace("$RANK", rank).replace("$TOKEN", token)
    return head + body + f"redis.call('SET', KEYS[5], {token} .. '|' .. table.concat(keys, ','))\nreturn out\n"


_CLAIM = _claim_script("ARGV[2]", "ARGV[3]", """local keys = {}
local n = tonumber(ARGV[1])
while #out < n do
  local it = redis.call('LPOP', KEYS[1])
  if not it then break end
  local k = cjson.decode(it)['key']
  if redis.call('HEXISTS', KEYS[3], k) == 0 then
    redis.call('HSET', KEYS[2], k, it)
    out[#out + 1] = it
    keys[#keys + 1] = k
  end
end
""")
_CLAIM_PROMPTS = _claim_script("ARGV[1]", "ARGV[2]", """local want = {}
for i = 3, #ARGV do want[tonumber(ARGV[i])] = true end
local keys, seen = {}, {}
local function take(it, d)
  if seen[d['key']] then return end
  seen[d['key']] = true
  if redis.call('HEXISTS', KEYS[3], d['key']) == 0 then
    redis.call('HSET', KEYS[2], d['key'], it)
    out[#out + 1] = it
    keys[#keys + 1] = d['key']
  end
end
for _, it in ipairs(redis.call('HVALS', KEYS[2])) do  -- already this rank's (an earlier claim of these prompts)
  local d = cjson.decode(it)
  if want[d['prompt']] then take(it, d) end
end
for _, it in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  local d = cjson.decode(it)
  if want[d['prompt']] then
    redis.call('LREM', KEYS[1], 1, it)
    take(it, d)
  end
end
""")
_COMPLETE = """
if redis.call('SISMEMBER', KEYS[3], ARGV[#ARGV]) == 1 then return -1 end
local new = 0
for i = 1, #ARGV - 1, 2 do
  new = new + redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1])
  redis.call('HDEL', KEYS[1], ARGV[i])
end
return new
"""
_RELEASE = """
local vals = redis.call('HVALS', KEYS[1])
for i = #vals, 1, -1 do
  local k = cjson.decode(vals[i])['key']
  if redis.call('HEXISTS', KEYS[3], k) == 0 then redis.call('LPUSH', KEYS[2], vals[i]) end
end
redis.call('DEL', KEYS[1], KEYS[4])
return #vals
"""


def sample_key(step: int, prompt: int, index: int) -> str:
    return f"{step}.{prompt}.{index}"


@dataclass(frozen=True)
class WorkItem:
    """One response to generate."""

    step: int  # RL step whose training batch this sample belongs to
    prompt: int  # prompt index within the step
    index: int  # response index within the prompt's group (0..G-1)
    prompt_ids: list[int]  # tokenised prompt
    seed: int  # per-sample seed derived from (run seed, step, prompt, index)
    key: str = ""  # sample key "step.prompt.index" (filled in)
    info: dict[str, Any] = field(default_factory=dict)  # what the reward needs: data_source, ground_truth, extra_info

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", sample_key(self.step, self.prompt, self.index))

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))  # its fields in order (asdict deep-copies: 7x slower)

    @classmethod
    def from_json(cls, raw: bytes | str) -> "WorkItem":
        d = json.loads(raw)
        d.pop("key", None)
        return cls(**d)


@dataclass(frozen=True)
class SampleResult:
    """One generated response with the behaviour policy's logprobs and version."""

    step: int
    prompt: int
    index: int
    response_ids: list[int]  # sampled tokens (EOS included when the response ended)
    logprobs: list[float]  # log-probability of each sampled token under the behaviour policy
    version: int  # policy version (updates applied) of the weights that generated it
    rank: int  # rank that generated it (for analysis only; never changes the sample)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return sample_key(self.step, self.prompt, self.index)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))  # its fields in order (asdict deep-copies: 7x slower)

    @classmethod
    def from_json(cls, raw: bytes | str) -> "SampleResult":
        d = json.loads(raw)
        if len(d.get("response_ids", [])) != len(d.get("logprobs", [])):
            raise ValueError("result has a different number of tokens and logprobs")
        return cls(**d)


class RolloutQueue:
    """Pull-based dispatch of one step's samples over Redis (see the module docstring)."""

    def __init__(self, client: redis.Redis, job_id: str, name: str = "wq"):
        self.r = client
        self.ns = Keys(job_id).ns
        self.name = name  # "wq": the training batches; "vq": validation passes (keyed by policy version)
        self.fenced_key = Keys(job_id).fenced  # ranks declared lost: claims and results refused
        self._publish = client.register_script(_PUBLISH)
        self._extend = client.register_script(_EXTEND)
        self._claim = client.register_script(_CLAIM)
        self._claim_prompts = client.register_script(_CLAIM_PROMPTS)
        self._complete = client.register_script(_COMPLETE)
        self._release = client.register_script(_RELEASE)

    def _k(self, step: int, what: str) -> str:
        return f"{self.ns}:{self.name}:{int(step)}:{what}"

    def publish(self, step: int, items: Iterable[WorkItem]) -> int:
        """Queue a step's items once; publishing the same step again (a retry, a resume) adds nothing."""
        items = list(items)
        return int(self._publish(keys=[self._k(step, "meta"), self._k(step, "pending")],
                                 args=[len(items), *[it.to_json() for it in items]]))

    def extend(self, step: int, round_: int, items: Iterable[WorkItem]) -> int:
        """Add extra round ``round_`` (>= 1) of a published step (dynamic sampling) once; the same round again (a
        retry, a resume replaying the plan) adds nothing. Returns the items added."""
        items = list(items)
        n = int(self._extend(keys=[self._k(step, "meta"), self._k(step, "pending")], args=[int(round_), *[it.to_json() for it in items]]))
        if n < 0:
            raise RuntimeError(f"step {step}: extra round {round_} before the step was published")
        return n

    def claim(self, step: int, rank: int, n: int, token: str | None = None) -> list[WorkItem]:
        """Take up to ``n`` unfinished items for ``rank`` (empty when nothing is left to claim, or the rank is fenced).

        ``token`` names this claim (a fresh one by default); the same token again returns the same items (those
        not completed or released meanwhile), which makes a claim retried after a lost reply take nothing new."""
        token = token or uuid.uuid4().hex
        keys = [self._k(step, "pending"), self._k(step, f"inflight:{rank}"), self._k(step, "results"), self.fenced_key,
                self._k(step, f"lastclaim:{rank}")]
        raw = self._claim(keys=keys, args=[n, int(rank), token])
        return [WorkItem.from_json(x) for x in raw or []]  # a fenced rank gets nothing

    def claim_prompts(self, step: int, rank: int, prompts: Iterable[int], token: str | None = None) -> list[WorkItem]:
        """Take every unfinished item of ``prompts`` for ``rank``: the pending ones, and those already in this rank's
        in-flight hash (an earlier claim of the same prompts); items with a result are left out, and a fenced rank
        gets nothing. Items of these prompts in flight on another rank stay there. Returned in (prompt, index) order.

        ``token`` works as in :meth:`claim`: the same token again returns that claim's unfinished items and takes
        nothing new. :meth:`release` puts the items back like any other claim's."""
        wanted = list(prompts)
        bad = [p for p in wanted if type(p) is not int or p < 0]
        if bad:
            raise ValueError(f"claim_prompts: prompt indices must be ints >= 0, got {bad[:5]!r}")
        token = token or uuid.uuid4().hex
        keys = [self._k(step, "pending"), self._k(step, f"inflight:{rank}"), self._k(step, "results"), self.fenced_key,
                self._k(step, f"lastclaim:{rank}")]
        raw = self._claim_prompts(keys=keys, args=[int(rank), token, *sorted(set(wanted))])
        return sorted((WorkItem.from_json(x) for x in raw or []), key=lambda it: (it.prompt, it.index))

    def complete(self, step: int, rank: int, results: Iterable[SampleResult]) -> int:
        """Record results; returns how many were new (a duplicate of a finished sample is dropped)."""
        args: list[str] = []
        for res in results:
            args += [res.key, res.to_json()]
        if not args:
            return 0
        new = int(self._complete(keys=[self._k(step, f"inflight:{rank}"), self._k(step, "results"), self.fenced_key],
                                 args=args + [int(rank)]))
        if new < 0:
            raise FencedRankError(f"rank {rank} was declared lost: its {len(args) // 2} result(s) of step {step} are refused")
        return new

    def release(self, step: int, rank: int) -> int:
        """Put back what ``rank`` claimed but did not finish (it left the rollout role or died)."""
        return int(self._release(keys=[self._k(step, f"inflight:{rank}"), self._k(step, "pending"), self._k(step, "results"),
                                       self._k(step, f"lastclaim:{rank}")]))

    def release_all(self) -> int:
        """Put back every claim of every step of this queue (returns the items put back). For a new launch of the
        ranks: a claim is bound to the process that made it, and no process of an earlier launch works on any more,
        whichever step it was (a schedule that ran ahead leaves claims of steps a resume reaches only later)."""
        n = 0
        for raw in self.r.scan_iter(match=f"{self.ns}:{self.name}:*:inflight:*", count=500):
            key = raw.decode() if isinstance(raw, bytes) else str(raw)
            step, what, rank = key.rsplit(":", 3)[1:]
            if what == "inflight" and step.isdigit() and rank.isdigit():
                n += self.release(int(step), int(rank))
        return n

    def total(self, step: int) -> int:
        v = self.r.hget(self._k(step, "meta"), "total")
        return int(v) if v is not None else 0

    def done(self, step: int) -> int:
        return int(self.r.hlen(self._k(step, "results")))

    def pending(self, step: int) -> int:
        return int(self.r.llen(self._k(step, "pending")))

    def results(self, step: int) -> list[SampleResult]:
        """All results of a step in sample order (prompt, index): independent of which rank made them."""
        out = [SampleResult.from_json(v) for v in self.r.hvals(self._k(step, "results"))]
        out.sort(key=lambda s: (s.prompt, s.index))
        return out

    def results_of(self, step: int, keys: list[str]) -> list[SampleResult]:
        """The results of these sample keys of a step, in the order given (one HMGET; a key without a result is
        left out)."""
        if not keys:
            return []
        return [SampleResult.from_json(v) for v in self.r.hmget(self._k(step, "results"), keys) if v is not None]

    def clear(self, step: int) -> None:
        keys = list(self.r.scan_iter(match=f"{self.ns}:{self.name}:{int(step)}:*", count=500))
        if keys:
            self.r.delete(*keys)
