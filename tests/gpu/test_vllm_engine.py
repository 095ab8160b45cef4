"""vLLM rollout engine on a real GPU: what only CUDA has (sleep mode, the CUDA kernels' reload and seeded sampling).
Skips cleanly without a GPU or without vllm: UNVERIFIED until this runs. The engine's contract on CPU (generate,
seeds, the stream, logprobs, weights, chat template) runs everywhere vLLM's CPU build does:
tests/integration/test_vllm_engine.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

vllm = pytest.importorskip("vllm", reason="vllm is not installed (the 'gpu' extra)")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from dynaresize.engines.protocol import RolloutError, SamplingParams  # noqa: E402
from dynaresize.engines.rollout_vllm import VllmRollout  # noqa: E402
from dynaresize.worker.config import VllmConfig  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = tmp_path_factory.mktemp("qwen2-tiny")
    torch.manual_seed(0)
    # head_dim 64 (hidden 128, 2 heads): what vLLM's attention backends accept
    m = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                     tie_word_embeddings=True))
    m.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def engine(model_dir):
    return VllmRollout(str(model_dir), eos_ids=[2], vllm_cfg=VllmConfig(gpu_memory_utilization=0.2, max_model_len=256),
                       dtype="float32", platform="cuda")


def test_generate_is_seeded_per_sample_and_has_logprobs(engine):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0)
    a = engine.generate([[1, 5, 6], [1, 7, 8, 9]], [11, 12], p)
    b = engine.generate([[1, 7, 8, 9]], [12], p)
    assert a[1].token_ids == b[0].token_ids
    assert all(len(g.token_ids) == len(g.logprobs) > 0 for g in a)
    assert all(lp <= 0 for g in a for lp in g.logprobs)


def test_sleep_wake_and_weight_reload_changes_outputs(engine, model_dir):
    p = SamplingParams(max_tokens=8, temperature=1.0)
    before = engine.generate([[1, 5, 6]], [3], p)[0]
    engine.sleep()
    with pytest.raises(RolloutError):
        engine.generate([[1, 5, 6]], [3], p)
    engine.wake_up(["weights"])
    names = engine.named_weights()
    g = torch.Generator().manual_seed(1)
    engine.load_weights([(n, torch.randn(t.shape, generator=g, dtype=torch.float32)) for n, t in names])
    engine.finish_weight_update(1)
    engine.wake_up(["kv_cache"])
    after = engine.generate([[1, 5, 6]], [3], p)[0]
    assert engine.version == 1
    assert after.logprobs != before.logprobs
