"""Continuous batching in the torch rollout engine against the one-batch decoding it replaces: the same tokens for
the same seed whatever the admission time, the slot count and the batch mix; abort; the emulated engine's slots.

The reference is the engine's one-batch loop as it was before the stream (``_one_batch`` below, the algorithm of
``TorchRollout.generate`` up to commit 7619bd3): every row left-padded to the batch's longest prompt, decoded
together until all ended. Tolerance: tokens equal exactly (fixed seeds, float32); logprobs within 1e-5 (the logits
of a row differ in the last bits with the batch shape: the module docstring's near-tie caveat)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dynaresize.engines.protocol import Request
from dynaresize.engines.protocol import Generation, RolloutError, SamplingParams
from dynaresize.engines.rollout_torch import _CACHE_KW, TorchRollout, _cache_of, top_p_filter

pytestmark = pytest.mark.unit

EOS = list(range(300, 330))  # 30 of 384 tokens end a response: lengths vary from 1 to max_tokens
PAD = 0


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def _one_batch(module, prompts, seeds, params: SamplingParams) -> list[Generation]:
    """Reference: the one-batch loop (left padding, one generator per row, all rows decoded until all ended)."""
    n, plen = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, plen), PAD, dtype=torch.long)
    mask = torch.zeros((n, plen), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, plen - len(p):] = torch.tensor(list(p))
        mask[i, plen - len(p):] = 1
    gens = [torch.Generator().manual_seed(int(s) & ((1 << 63) - 1)) for s in seeds]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = module(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    past, logits = _cache_of(out), out.logits[:, -1, :]
    eos = torch.tensor(EOS)
    tokens, lps = [[] for _ in range(n)], [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool)
    next_pos = pos[:, -1:] + 1
    for _ in range(params.max_tokens):
        logp = torch.log_softmax(top_p_filter(logits.float() / params.temperature, params.top_p), dim=-1)
        probs = logp.exp()
        nxt = torch.full((n,), PAD, dtype=torch.long)
        for i in range(n):
            if done[i]:
                continue
            tok = int(torch.multinomial(probs[i], 1, generator=gens[i]))
            nxt[i] = tok
            tokens[i].append(tok)
            lps[i].append(float(logp[i, tok]))
            done[i] = bool((eos == tok).any())
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
        out = module(input_ids=nxt.unsqueeze(1), attention_mask=mask, position_ids=next_pos, use_cache=True,
                     **{_CACHE_KW: past})
        past, logits = _cache_of(out), out.logits[:, -1, :]
        next_pos = next_pos + 1
    return [Generation(t, l) for t, l in zip(tokens, lps)]


def _prompts(n: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(1, 290) for _ in range(rng.randrange(2, 12))) for _ in range(n)]


def _same(got: Generation, want: Generation, what: str) -> None:
    assert got.token_ids == want.token_ids, what
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5), what


PARAMS = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9)]


@pytest.mark.parametrize("params", PARAMS)
def test_generate_draws_the_one_batch_tokens(model, params):
    prompts, seeds = _prompts(12, 1), [1000 + i for i in range(12)]
    want = _one_batch(model, prompts, seeds, params)
    assert len({len(w.token_ids) for w in want}) > 3  # the lengths vary: rows leave the batch at different steps
    got = TorchRollout(model, EOS, PAD).generate(prompts, seeds, params)
    for i, (g, w) in enumerate(zip(got, want)):
        _same(g, w, f"sample {i}")


@pytest.mark.parametrize("slots", [1, 3, 5, 64])
def test_streaming_admission_at_any_time_and_mix_keeps_each_seeds_tokens(model, slots):
    """Requests arrive in three commands at different iterations, into few or many slots; each sample equals its
    one-batch decoding alone (batch of one) and within its own command's batch."""
    params = PARAMS[0]
    prompts, seeds = _prompts(18, 2), [7 * i + 3 for i in range(18)]
    alone = [_one_batch(model, [p], [s], params)[0] for p, s in zip(prompts, seeds)]
    eng = TorchRollout(model, EOS, PAD, max_running=slots)
    reqs = [Request(f"k{i}", p, s, params) for i, (p, s) in enumerate(zip(prompts, seeds))]
    arrivals = {0: reqs[:6], 3: reqs[6:13], 9: reqs[13:]}  # iteration -> the requests added before it
    got, it = {}, 0
    while it <= max(arrivals) or eng.running:
        if it in arrivals:
            eng.add(arrivals[it])
        assert len(eng._rows) <= slots
        for f in eng.step():
            got[f.key] = f.generation
        it += 1
    assert sorted(got) == sorted(r.key for r in reqs)
    for i in range(18):
        _same(got[f"k{i}"], alone[i], f"sample {i} with {slots} slots")
    batch = _one_batch(model, prompts[6:13], seeds[6:13], params)
    for j, w in enumerate(batch):
        _same(got[f"k{6 + j}"], w, f"sample {6 + j} against its command's one batch")


def test_abort_drops_running_and_waiting_requests_and_keeps_the_others(model):
    params = PARAMS[0]
    prompts, seeds = _prompts(6, 3), list(range(6))
    eng = TorchRollout(model, EOS, PAD, max_running=4)
    eng.add([Request(f"k{i}", p, s, params) for i, (p, s) in enumerate(zip(prompts, seeds))])
    got = {f.key: f.generation for f in eng.step()}
    assert "k1" not in got and len(eng._rows) == 4 and eng.waiting == 2
    assert eng.abort(["k1", "k5", "nope"]) == ["k1", "k5"]  # k1 runs, k5 waits; an unknown key is no error
    while eng.running:
        got.update({f.key: f.generation for f in eng.step()})
    assert "k1" not in got and "k5" not in got
    for i in (0, 2, 3, 4):
        _same(got[f"k{i}"], _one_batch(model, [prompts[i]], [seeds[i]], params)[0], f"sample {i}")
    eng.add([Request("k9", prompts[0], seeds[0], params)])
    assert eng.abort() == ["k9"] and eng.running == 0 and eng.step() == []


def test_bad_requests_are_refused_by_name(model):
    eng = TorchRollout(model, EOS, PAD)
    with pytest.raises(RolloutError, match="'a': empty prompt"):
        eng.add([Request("a", (), 1, PARAMS[0])])
    eng.add([Request("b", (1, 2), 1, PARAMS[0])])
    with pytest.raises(RolloutError, match="'b' is already in the engine"):
        eng.add([Request("b", (1, 2), 1, PARAMS[0])])
    with pytest.raises(RolloutError, match="streamed requests run"):
        eng.generate([[1, 2]], [1], PARAMS[0])
    with pytest.raises(RolloutError, match="max_running"):
        TorchRollout(model, EOS, PAD, max_running=0)


def test_emulated_engine_paces_each_iteration_for_the_sequences_in_its_slots(model):
    """The emulated engine's slots are the simulated GPU's sequence cap; each decode iteration is charged
    TimingModel.decode_iteration_s of the sequences in the slots (refilled as responses end, as the sample-level
    simulator's continuous batching); a group's shared prompt is prefilled once. Same tokens as the torch engine."""
    from dynaresize.config.schema import Config
    from dynaresize.emulation.engine import EmulatedRollout, Emulator
    from dynaresize.emulation.pacer import Pacer

    c = Config.model_validate({"cluster": {"device": "emulated", "gpus": 4}, "sim": {"rollout": {"max_seqs_per_gpu": 3}}})
    emu = Emulator(c, 4)
    now = [0.0]
    emu.pacer = Pacer(10.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))  # a fake clock
    charged: list[tuple[int, float]] = []
    prefilled: list[float] = []
    model_decode, model_prefill = emu.model.decode_iteration_s, emu.model.prefill_s
    emu.model.decode_iteration_s = lambda a, ctx: charged.append((a, ctx)) or model_decode(a, ctx)
    emu.model.prefill_s = lambda tokens: prefilled.append(tokens) or model_prefill(tokens)
    eng = EmulatedRollout(model, EOS, PAD, "cpu", emulator=emu, max_running=8)
    assert eng.max_running == 3  # min(rollout.max_running, sim.rollout.max_seqs_per_gpu)
    params = PARAMS[0]
    group = [(5, 6, 7, 8)] * 4 + [(9, 10)] * 2  # two groups: G=4 responses of one prompt, G=2 of another
    reqs = [Request(f"k{i}", p, 50 + i, params) for i, p in enumerate(group)]
    eng.add(reqs)
    expect, got = [], {}
    while eng.running:
        expect.append(min(3, eng.running))
        got.update({f.key: f.generation for f in eng.step()})
    assert [a for a, _ in charged] == expect and max(expect) == 3
    assert len(expect) < sum(len(g.token_ids) for g in got.values())  # slots were refilled, not one sample at a time
    assert prefilled[0] == 4  # the first three requests share one prompt: one prefill of its 4 tokens
    # a newcomer whose prompt a running request holds is not prefilled again (0); one that left the cache is
    assert set(prefilled) <= {0, 2, 4} and 0 in prefilled and sum(prefilled) < 4 * 4 + 2 * 2
    want = TorchRollout(model, EOS, PAD).generate([r.prompt_ids for r in reqs], [r.seed for r in reqs], params)
    for i, w in enumerate(want):
        _same(got[f"k{i}"], w, f"emulated sample {i}")
    assert emu.pacer.to_json()["decode"]["modelled_s"] == pytest.approx(sum(model_decode(a, x) for a, x in charged))


def test_emulated_engine_overlaps_host_work_between_iterations_and_banks_no_idle_time(model, monkeypatch):
    """While sequences run, an iteration begins where the previous one ended (the host's work between iterations
    overlaps the emulated device's, as an asynchronously launched decode on a GPU): host work shorter than the
    iterations adds nothing and is no overrun, longer host work is an overrun; once the engine is empty the chain
    ends, so an idle wait before the next request is not taken out of that request's modelled time (fake clock)."""
    from dynaresize.config.schema import Config
    from dynaresize.emulation.engine import EmulatedRollout, Emulator
    from dynaresize.emulation.pacer import Pacer

    c = Config.model_validate({"cluster": {"device": "emulated", "gpus": 4}, "sim": {"rollout": {"max_seqs_per_gpu": 4}}})
    emu = Emulator(c, 4)
    now = [0.0]
    emu.pacer = Pacer(0.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    import types

    import dynaresize.engines.rollout_torch as rt

    monkeypatch.setattr(rt, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))  # the engine's span starts too
    eng = EmulatedRollout(model, EOS, PAD, "cpu", emulator=emu, max_running=4)
    params = PARAMS[0]

    def run(host_s: float, key: str) -> float:
        """Decode two requests to their end with ``host_s`` of host work before every step; the time it took."""
        t0 = now[0]
        eng.add([Request(f"{key}{i}", (5, 6, 7), 10 + i, params) for i in range(2)])
        while eng.running:
            now[0] += host_s
            eng.step()
        return now[0] - t0

    def modelled() -> float:
        return sum(k.modelled_s for k in emu.pacer.kinds.values())

    m0 = modelled()
    took = run(0.2 * emu.model.decode_iteration_s(1, 3.0), "a")  # host work shorter than any iteration
    assert took == pytest.approx(0.2 * emu.model.decode_iteration_s(1, 3.0) + modelled() - m0)  # only the first one shows
    assert emu.pacer.overruns == 0
    now[0] += 100.0  # the engine is empty: an idle device banks nothing
    m1 = modelled()
    took = run(0.0, "b")
    assert took == pytest.approx(modelled() - m1) and emu.pacer.overruns == 0
    run(10.0, "c")  # host work longer than every iteration: each iteration overran (the host's time is not hidden)
    assert emu.pacer.overruns > 0
