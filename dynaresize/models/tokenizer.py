"""The tiny model's tokenizer: a byte-level BPE trained offline on text the task generates, with a chat template.

Why a trained subword tokenizer (and not one token per character): the tiny model must take exactly the code path
a real model takes (``AutoTokenizer`` from its directory, ``apply_chat_template`` for chat prompts, its own EOS and
pad tokens, subword pieces that do not line up with characters), so that what the quickstart and the tests exercise
is what a user's Qwen or Llama directory goes through.

What it is: the ``tokenizers`` library's BPE over bytes (GPT-2's byte alphabet, so any text encodes and nothing is
ever unknown), digits split one per token before merging (as Llama 3 and Qwen do: arithmetic stays learnable),
``model.tiny.vocab_size`` entries in all, pieces of at most ``model.tiny.max_token_chars`` characters (without a cap,
BPE learns whole letter runs of the quickstart's task as single tokens and its answers stop growing), trained in
well under a second on a corpus from the task
(:func:`dynaresize.models.store.tokenizer_corpus`). Special tokens first: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2
(PAD != EOS, so padding is never mistaken for an answer's end), then the chat role markers. Plain text gets
``<bos>`` prepended (the post-processor); chat messages are rendered by :data:`CHAT_TEMPLATE`::

    <bos><|system|>You add numbers.<eos><|user|>What is 2+3?<eos><|assistant|>

and the assistant's answer ends with ``<eos>``, the model's EOS. Left padding (what batched generation wants).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
ROLES = ("system", "user", "assistant")
SPECIALS = (PAD, BOS, EOS, *(f"<|{r}|>" for r in ROLES))

#: Jinja chat template of the tiny model (saved with the tokenizer; ``apply_chat_template`` renders it).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 384, max_token_chars: int = 2) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on ``corpus`` (deterministic for a given corpus) and wrap it as an HF tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=max_token_chars, show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left",
        additional_special_tokens=[f"<|{r}|>" for r in ROLES],
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf
