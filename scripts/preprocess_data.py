"""Tokenize text into megatron-core's indexed dataset format (``.bin`` token data + ``.idx`` index).

A subset of Megatron-LM's ``tools/preprocess_data.py`` command line. Inputs, in the order given:

* a ``.jsonl``/``.json`` file: one JSON object per line, the document is the ``--json-keys`` value;
* any other file: the whole file, read as UTF-8, is one document;
* a directory: every file below it whose name matches ``--glob``, in sorted path order.

The output is ``{--output-prefix}_{key}_document.bin/.idx`` with one sequence per document, written
by megatron-core's ``IndexedDatasetBuilder`` and moved into place only once complete. Empty
documents are skipped. Bad input (a missing file, no documents, a record without the key, text
that is not UTF-8) ends the run with a one-line error and exit status 2, leaving no output behind.
"""

import argparse
import fnmatch
import functools
import json
import multiprocessing
import os
import sys
import warnings
from pathlib import Path
from typing import Iterable, Iterator, List, NamedTuple, Sequence, Tuple

sys.path.append(os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_elaswave.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

JSON_LINES_SUFFIXES = {".jsonl", ".json"}


class InputError(Exception):
    """Input the run cannot use; reported as a one-line error."""


class Document(NamedTuple):
    source: str  # "path" or "path:line", for error messages
    text: str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input")
    group.add_argument("--input", nargs="+", required=True, help="files and/or directories")
    group.add_argument(
        "--glob", default="*", help="file name pattern for files found in directories (default *)"
    )
    group.add_argument(
        "--json-keys", default="text", help="key of the document text in JSON lines (default text)"
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument(
        "--tokenizer-type", required=True, help=f"one of {', '.join(TOKENIZER_TYPES)}"
    )
    group.add_argument("--vocab-size", type=int, help="vocabulary size for NullTokenizer")
    group.add_argument("--append-eod", action="store_true", help="end each document with eod")
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    return parser


def resolve_input_files(inputs: Sequence[str], pattern: str) -> List[Path]:
    """Expand the ``--input`` paths into files, keeping the given order and sorting directories."""
    files = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            files.extend(
                sorted(
                    file
                    for file in path.rglob("*")
                    if file.is_file() and fnmatch.fnmatch(file.name, pattern)
                )
            )
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(f"no such file or directory: {name}")
    if not files:
        raise InputError(f"no input files match --glob {pattern!r} in {' '.join(inputs)}")
    return files


def read_documents(files: Iterable[Path], key: str) -> Iterator[Document]:
    for file in files:
        if file.suffix in JSON_LINES_SUFFIXES:
            yield from _read_json_lines(file, key)
        else:
            try:
                yield Document(str(file), file.read_bytes().decode("utf-8"))
            except UnicodeDecodeError as error:
                raise InputError(f"{file}: not UTF-8 text ({error.reason})") from None


def _read_json_lines(file: Path, key: str) -> Iterator[Document]:
    with file.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            source = f"{file}:{number}"
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:  # includes UnicodeDecodeError
                raise InputError(f"{source}: not valid JSON ({error})") from None
            if not isinstance(record, dict):
                raise InputError(f"{source}: not a JSON object")
            if key not in record:
                raise InputError(f"{source}: no key {key!r} (keys: {', '.join(map(repr, record))})")
            if not isinstance(record[key], str):
                raise InputError(f"{source}: {key!r} is not a string")
            yield Document(source, record[key])


def encode_document(tokenizer, append_eod: bool, document: Document) -> List[int]:
    """Token ids of one document; runs in worker processes when ``--workers`` > 1."""
    try:
        ids = tokenizer.tokenize(document.text)
    except ValueError as error:  # includes UnicodeEncodeError for lone surrogates
        raise InputError(f"{document.source}: cannot tokenize ({error})") from None
    if ids and append_eod:
        ids.append(tokenizer.eod)
    return ids


def encode_documents(
    documents: Iterable[Document], tokenizer, append_eod: bool, workers: int
) -> Iterator[List[int]]:
    """Token ids per document, in input order."""
    encode = functools.partial(encode_document, tokenizer, append_eod)
    if workers == 1:
        yield from map(encode, documents)
        return
    with multiprocessing.Pool(workers) as pool:
        yield from pool.imap(encode, documents, chunksize=16)


def write_indexed_dataset(
    token_ids: Iterable[List[int]], path_prefix: str, vocab_size: int
) -> Tuple[int, int, int]:
    """Write one sequence per non-empty document to ``path_prefix.bin/.idx``.

    Returns (documents written, tokens written, empty documents skipped). Files are written under
    temporary names and renamed at the end, so the prefix never names a partial dataset.
    """
    # Importing megatron-core takes seconds; keep it out of the argument and input checks.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Transformer Engine and Apex are not installed")
        from megatron.core.datasets.indexed_dataset import (
            DType,
            IndexedDatasetBuilder,
            get_bin_path,
            get_idx_path,
        )

    bin_path, idx_path = get_bin_path(path_prefix), get_idx_path(path_prefix)
    partial_bin, partial_idx = bin_path + ".partial", idx_path + ".partial"
    Path(bin_path).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(partial_bin, dtype=DType.optimal_dtype(vocab_size))
    documents = tokens = skipped = 0
    try:
        for ids in token_ids:
            if not ids:
                skipped += 1
                continue
            builder.add_document(ids, [len(ids)])
            documents += 1
            tokens += len(ids)
        if documents == 0:
            raise InputError("the input holds no non-empty documents")
    except BaseException:
        builder.finalize(partial_idx)  # closes the .bin file
        os.remove(partial_bin)
        os.remove(partial_idx)
        raise
    builder.finalize(partial_idx)
    os.replace(partial_bin, bin_path)
    os.replace(partial_idx, idx_path)
    return documents, tokens, skipped


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    path_prefix = f"{args.output_prefix}_{args.json_keys}_document"
    try:
        try:
            tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size)
        except ValueError as error:
            raise InputError(str(error)) from None
        files = resolve_input_files(args.input, args.glob)
        documents = read_documents(files, args.json_keys)
        token_ids = encode_documents(documents, tokenizer, args.append_eod, args.workers)
        written, tokens, skipped = write_indexed_dataset(
            token_ids, path_prefix, tokenizer.vocab_size
        )
    except InputError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    skipped_note = f" ({skipped} empty skipped)" if skipped else ""
    print(
        f"{written} documents{skipped_note}, {tokens} tokens -> "
        f"{path_prefix}.bin, {path_prefix}.idx"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
