"""A character-level tokenizer built offline from a task's alphabet (no hub, no training data).

One token per character (WordLevel over the alphabet, split per character), four special tokens first
(``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3; PAD != EOS so padding is never mistaken for an answer's end),
``decoders.Fuse()`` so decoding does not insert spaces, a template that prepends ``<bos>``, and left padding (what
batched generation wants). Saved and reloaded through ``AutoTokenizer`` like any HF tokenizer.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)


def vocabulary(alphabet: str) -> dict[str, int]:
    """Specials, then each distinct character of ``alphabet`` in order of first appearance."""
    chars = list(dict.fromkeys(alphabet))
    if any(c.isspace() for c in chars):
        raise ValueError(f"task alphabet {alphabet!r}: whitespace characters are not supported")
    return {tok: i for i, tok in enumerate([*SPECIALS, *chars])}


def build_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    vocab = vocabulary(alphabet)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
    )
