"""A GGUF file's tokenizer behind the few methods of transformers' tokenizers that fimble calls.

Why not ``transformers.PreTrainedTokenizerFast``: wrapping a 151,936-token vocabulary costs about
1.3 s, and importing transformers about 0.8 s more, on a 2-core CPU: a third of the default model's
start, for methods that are each a call into the same Rust ``tokenizers.Tokenizer``. Each method here
is that call, with transformers' meaning of its arguments (tests/engine/test_gguf.py holds the two
equal on ids and texts).
"""

from __future__ import annotations

from tokenizers import Tokenizer


class BPETokenizer:
    """The subset of a transformers fast tokenizer's interface used by the engine, for GGUF vocabularies."""

    add_bos_token = False  # GGUF files fimble loads carry no BOS (llama.cpp's add_bos_token is false)
    bos_token_id: int | None = None

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None) -> None:
        self.backend_tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        added = tokenizer.get_added_tokens_decoder()
        self._added = {t.content: i for i, t in added.items()}
        self.all_special_ids = sorted(i for i, t in added.items() if t.special)
        self._size = tokenizer.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self._size

    def encode(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. ``split_special_tokens``: a special token's text in ``text`` is plain text."""
        tok = self.backend_tokenizer
        tok.encode_special_tokens = split_special_tokens
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False
    ) -> str:
        if clean_up_tokenization_spaces:  # transformers' English clean-up: never asked for on code
            raise ValueError("clean_up_tokenization_spaces is not supported")
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, sequences: list[list[int]], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False
    ) -> list[str]:
        if clean_up_tokenization_spaces:
            raise ValueError("clean_up_tokenization_spaces is not supported")
        return self.backend_tokenizer.decode_batch(
            [list(s) for s in sequences], skip_special_tokens=skip_special_tokens
        )

    def token_id(self, token: str) -> int | None:
        """``get_vocab().get(token)`` without building the whole dict."""
        return self.backend_tokenizer.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        return dict(self._added)
