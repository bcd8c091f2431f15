"""Tiny text for the Hugging Face tests: a word list and a word-level tokenizer trained here (no model
hub): [PAD] 0, [UNK] 1, [EOS] 2."""

from __future__ import annotations

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "a",
    "cat",
    "sat",
    "on",
    "mat",
    "privacy",
    "budget",
    "consent",
    "group",
]


def word_tokenizer(texts, append_eos: bool = False):
    """A word-level tokenizer trained on ``texts`` (with ``append_eos``: [EOS] appended to each text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    if append_eos:
        tk.post_processor = processors.TemplateProcessing(single="$A [EOS]", special_tokens=[("[EOS]", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
