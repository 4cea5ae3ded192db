"""Tokenizers that megatron-core's GPT datasets accept as ``GPTDatasetConfig(tokenizer=...)``.

Each tokenizer provides what megatron-core reads from the config's tokenizer:

* ``vocab_size``: bounds the ids, and so picks the token dtype (uint16 up to 65536 ids),
* ``eod``: the end-of-document id, used for loss masks and position/attention resets,
* ``pad``: the id megatron-core masks out of the loss when it pads a sample,
* ``unique_identifiers``: hashed into the key of the dataset index cache,

plus ``tokenize``/``detokenize`` for preprocessing and inspection. Like megatron-core's own
``NullTokenizer`` they are plain classes rather than ``MegatronTokenizerBase`` subclasses: this
module imports neither torch nor megatron, so command-line tools can validate their input before
paying for those imports.

The vocabulary sizes here are unpadded; padding the embedding table (e.g. to a multiple of
``make_vocab_size_divisible_by * tensor_model_parallel_size``) is left to the caller.
"""

from collections import OrderedDict
from typing import Iterable, List, Optional, Sequence, Union

import numpy

# Megatron-core's own fill value for padding it appends to a short sample; never a real token id.
_NO_PAD_ID = -1


class ByteLevelTokenizer:
    """UTF-8 bytes as ids 0..255 and an end-of-document id 256: a vocabulary of 257 ids.

    Lossless: ``detokenize(tokenize(text)) == text`` for every string that UTF-8 can encode, and
    ``detokenize`` drops the end-of-document id, so a stored document decodes to its source text.
    """

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod(self) -> int:
        return 256

    @property
    def pad(self) -> int:
        """No pad id in the vocabulary: padding uses megatron-core's out-of-vocabulary -1."""
        return _NO_PAD_ID

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}")])

    def tokenize(self, text: str) -> List[int]:
        """Return the UTF-8 bytes of ``text``; raises ``UnicodeEncodeError`` on lone surrogates."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode byte ids (a list, NumPy array or CPU tensor), skipping end-of-document ids.

        A sample cut from the middle of a multi-byte character still decodes: the partial
        character becomes U+FFFD.
        """
        ids = numpy.asarray(ids, dtype=numpy.int64)
        ids = ids[ids != self.eod]
        out_of_range = ids[(ids < 0) | (ids > 255)]
        if out_of_range.size:
            raise ValueError(
                f"{type(self).__name__} ids must lie in [0, 256], got {int(out_of_range[0])}"
            )
        return ids.astype(numpy.uint8).tobytes().decode("utf-8", errors="replace")


class NullTokenizer:
    """Pre-tokenized input, as Megatron-LM's ``NullTokenizer``: text is whitespace-separated ids.

    ``NullTokenizer(n)`` takes ids 0..n-1 as given and adds the end-of-document id ``n``, so its
    ``vocab_size`` is ``n + 1`` and ``eod == vocab_size - 1``.
    """

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size_without_eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        return self._vocab_size_without_eod

    @property
    def pad(self) -> int:
        return _NO_PAD_ID

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("vocab_size", self.vocab_size),
            ]
        )

    def tokenize(self, text: str) -> List[int]:
        try:
            ids = [int(token) for token in text.split()]
        except ValueError:
            raise ValueError(
                f"{type(self).__name__} expects whitespace-separated integer ids"
            ) from None
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise ValueError(f"{type(self).__name__} ids must lie in [0, {self.vocab_size})")
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


TOKENIZER_TYPES = ("ByteLevelTokenizer", "NullTokenizer")


def build_tokenizer(
    tokenizer_type: str, vocab_size: Optional[int] = None
) -> Union[ByteLevelTokenizer, NullTokenizer]:
    """Build a tokenizer from Megatron-LM style ``--tokenizer-type`` and ``--vocab-size`` values.

    Raises:
        ValueError: for an unknown type, or a ``vocab_size`` the type cannot honour.
    """
    if tokenizer_type == "ByteLevelTokenizer":
        if vocab_size is not None:
            raise ValueError(
                "ByteLevelTokenizer has a fixed vocabulary of 257 ids; "
                "--vocab-size applies to NullTokenizer only"
            )
        return ByteLevelTokenizer()
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise ValueError("NullTokenizer needs --vocab-size of at least 1")
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"unknown tokenizer type {tokenizer_type!r}; expected one of {', '.join(TOKENIZER_TYPES)}"
    )
