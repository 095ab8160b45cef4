"""The policy model: a tiny LLaMA-style model and a character tokenizer built locally, warm-started, cached.

``ensure_model(cfg) -> Path`` is the one entry point (an HF directory loadable by ``AutoModelForCausalLM`` /
``AutoTokenizer``, hence by vLLM and DeepSpeed); ``load_model`` / ``load_tokenizer`` read it back offline.
"""

from dynaresize.models.store import cache_key, ensure_model, load_model, load_tokenizer

__all__ = ["cache_key", "ensure_model", "load_model", "load_tokenizer"]
