"""The policy model: a local HF model directory, the user's (``model.path``) or the tiny one built here.

``ensure_model(cfg) -> Path`` is the one entry point (an HF directory loadable by ``AutoModelForCausalLM`` /
``AutoTokenizer``, hence by vLLM and DeepSpeed); ``load_model`` / ``load_tokenizer`` read it back offline, and
``dynaresize.models.hf`` holds what every engine asks of such a directory (stop tokens, prompt rendering, dtype).
"""

from dynaresize.models.hf import load_model, load_tokenizer
from dynaresize.models.store import cache_key, ensure_model

__all__ = ["cache_key", "ensure_model", "load_model", "load_tokenizer"]
