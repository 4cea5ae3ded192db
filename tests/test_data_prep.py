"""Data preparation: byte-level tokenizer, stdlib demo corpus, indexed dataset, GPT datasets.

Everything runs in one process without torch.distributed; the scripts are imported and their
``main`` called directly, except for one check of the command line as a user runs it.
"""

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy
import pytest

from megatron_elaswave.tokenizer import ByteLevelTokenizer, NullTokenizer, build_tokenizer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's import-time notices about optional packages
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
CORPUS_MAX_BYTES = 200_000
SEQUENCE_LENGTH = 256


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # worker processes find pickled functions by module name
    spec.loader.exec_module(module)
    return module


make_demo_corpus = _load_script("make_demo_corpus")
preprocess_data = _load_script("preprocess_data")


def _preprocess(*argv):
    """Run preprocess_data in-process; return (exit status, stdout, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = preprocess_data.main(["--tokenizer-type", "ByteLevelTokenizer", *map(str, argv)])
    return status, stdout.getvalue(), stderr.getvalue()


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def stdlib_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "stdlib.jsonl"
    argv = ["--output", str(path), "--max-bytes", str(CORPUS_MAX_BYTES)]
    with contextlib.redirect_stdout(io.StringIO()):
        status = make_demo_corpus.main(argv)
    assert status == 0
    return path


@pytest.fixture(scope="module")
def stdlib_dataset(stdlib_corpus, tmp_path_factory):
    """(path prefix, summary line) of the demo corpus preprocessed with --append-eod."""
    output_prefix = tmp_path_factory.mktemp("data") / "stdlib"
    status, stdout, stderr = _preprocess(
        "--input", stdlib_corpus, "--output-prefix", output_prefix, "--append-eod"
    )
    assert status == 0, stderr
    return f"{output_prefix}_text_document", stdout


# Tokenizers


def test_byte_level_tokenizer_round_trips_any_text():
    tokenizer = ByteLevelTokenizer()
    text = "naïve café – 漢字 🙂\r\n\x00tab\there"
    ids = tokenizer.tokenize(text)

    assert ids == list(text.encode("utf-8"))
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (257, 256, -1)
    assert tokenizer.detokenize(ids) == text
    assert tokenizer.detokenize(numpy.array(ids + [tokenizer.eod])) == text
    assert tokenizer.detokenize(tokenizer.tokenize("é")[:1]) == "\ufffd"
    with pytest.raises(ValueError, match="ids must lie in"):
        tokenizer.detokenize([65, 300])


def test_build_tokenizer_follows_megatron_lm_flags():
    assert isinstance(build_tokenizer("ByteLevelTokenizer"), ByteLevelTokenizer)

    null = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert isinstance(null, NullTokenizer)
    assert (null.vocab_size, null.eod) == (1001, 1000)
    assert null.tokenize("3 1 4\n1") == [3, 1, 4, 1]
    assert null.detokenize([3, 1, 4]) == "3 1 4"

    with pytest.raises(ValueError, match="unknown tokenizer type 'GPT2BPE'"):
        build_tokenizer("GPT2BPE")
    with pytest.raises(ValueError, match="needs --vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="fixed vocabulary"):
        build_tokenizer("ByteLevelTokenizer", vocab_size=512)


# Demo corpus


def test_stdlib_corpus_is_reproducible_and_capped(stdlib_corpus, tmp_path):
    again = tmp_path / "again.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        make_demo_corpus.main(["--output", str(again), "--max-bytes", str(CORPUS_MAX_BYTES)])
    records = _read_jsonl(stdlib_corpus)
    paths = [record["path"] for record in records]

    assert again.read_bytes() == stdlib_corpus.read_bytes()
    assert len(records) > 5 and paths == sorted(paths)
    assert sum(len(record["text"].encode("utf-8")) for record in records) <= CORPUS_MAX_BYTES
    root = make_demo_corpus.stdlib_root()
    assert records[0]["text"] == (root / paths[0]).read_bytes().decode("utf-8")


def test_corpus_skips_non_utf8_and_third_party_files(tmp_path):
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third_party.py").write_text("x = 1\n")
    (tmp_path / "a.py").write_text("a = 1\n")
    (tmp_path / "b_latin1.py").write_bytes(b"# caf\xe9\n")
    (tmp_path / "c.py").write_text("c = 3\n")
    (tmp_path / "d_too_big.py").write_text("d = 4\n" * 10)
    (tmp_path / "e.py").write_text("e = 5\n")

    sources = list(make_demo_corpus.iter_sources(tmp_path, max_bytes=20))

    assert [source.path for source in sources] == ["a.py", "c.py"]


# Indexed dataset


def test_indexed_dataset_round_trips_documents(stdlib_corpus, stdlib_dataset):
    path_prefix, summary = stdlib_dataset
    tokenizer = ByteLevelTokenizer()
    texts = [record["text"] for record in _read_jsonl(stdlib_corpus) if record["text"]]
    dataset = IndexedDataset(path_prefix)

    assert len(dataset) == len(texts)
    assert dataset[0].dtype == numpy.uint16  # smallest dtype that holds 257 ids
    for document, text in zip(dataset, texts):
        assert document[-1] == tokenizer.eod
        assert tokenizer.detokenize(document) == text
    tokens = int(dataset.sequence_lengths.sum())
    assert summary.startswith(f"{len(texts)} documents")
    assert f"{tokens} tokens -> {path_prefix}.bin, {path_prefix}.idx" in summary


def test_directory_input_with_glob_takes_files_in_sorted_order(tmp_path):
    source = tmp_path / "src"
    (source / "pkg").mkdir(parents=True)
    files = {"b.py": "b = 2\n", "a.py": "a = 1\n", "pkg/c.py": "c = 3\n", "notes.txt": "skip me"}
    for name, text in files.items():
        (source / name).write_text(text)

    status, _, stderr = _preprocess(
        "--input", source, "--glob", "*.py", "--output-prefix", tmp_path / "out"
    )
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))

    assert status == 0, stderr
    assert [ByteLevelTokenizer().detokenize(doc) for doc in dataset] == [
        files["a.py"],
        files["b.py"],
        files["pkg/c.py"],
    ]
    assert dataset[0][-1] != ByteLevelTokenizer().eod  # no --append-eod


def test_worker_processes_write_identical_files(stdlib_corpus, stdlib_dataset, tmp_path):
    path_prefix, _ = stdlib_dataset
    status, _, stderr = _preprocess(
        "--input",
        stdlib_corpus,
        "--output-prefix",
        tmp_path / "par",
        "--append-eod",
        "--workers",
        "2",
    )

    assert status == 0, stderr
    for suffix in (".bin", ".idx"):
        written = Path(f"{tmp_path}/par_text_document{suffix}").read_bytes()
        assert written == Path(path_prefix + suffix).read_bytes()


def _write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)


_MISSING_KEY = '{"text": "ok"}\n{"body": "no text"}\n'


@pytest.mark.parametrize(
    "files, extra_args, message",
    [
        pytest.param(
            {},
            ["--input", "missing.jsonl"],
            "no such file or directory: missing.jsonl",
            id="missing",
        ),
        pytest.param(
            {"empty/.keep": ""},
            ["--input", "empty", "--glob", "*.py"],
            "no input files match",
            id="no-files",
        ),
        pytest.param(
            {"docs.jsonl": _MISSING_KEY},
            ["--input", "docs.jsonl"],
            "docs.jsonl:2: no key 'text' (keys: 'body')",
            id="unknown-key",
        ),
        pytest.param(
            {"docs.jsonl": _MISSING_KEY},
            ["--input", "docs.jsonl", "--workers", "2"],
            "docs.jsonl:2: no key 'text'",
            id="unknown-key-workers",
        ),
        pytest.param(
            {"docs.jsonl": '{"text": "ok"}\n{text\n'},
            ["--input", "docs.jsonl"],
            "docs.jsonl:2: not valid JSON",
            id="bad-json",
        ),
        pytest.param(
            {"docs.jsonl": '{"text": "\\ud800"}\n'},
            ["--input", "docs.jsonl"],
            "docs.jsonl:1: cannot tokenize",
            id="lone-surrogate",
        ),
        pytest.param(
            {"latin1.txt": b"caf\xe9"},
            ["--input", "latin1.txt"],
            "latin1.txt: not UTF-8 text",
            id="not-utf8",
        ),
        pytest.param(
            {"empty.txt": ""}, ["--input", "empty.txt"], "no non-empty documents", id="empty"
        ),
        pytest.param(
            {"a.txt": "a"},
            ["--input", "a.txt", "--tokenizer-type", "Foo"],
            "unknown tokenizer type 'Foo'",
            id="unknown-tokenizer",
        ),
    ],
)
def test_bad_input_is_a_one_line_error(tmp_path, monkeypatch, files, extra_args, message):
    monkeypatch.chdir(tmp_path)
    for name, content in files.items():
        _write(tmp_path / name, content)

    status, stdout, stderr = _preprocess(*extra_args, "--output-prefix", "out/bad")

    assert status == 2
    assert stdout == ""
    assert stderr.count("\n") == 1 and message in stderr
    assert not list(tmp_path.glob("out/bad*"))  # no partial dataset left behind


def test_command_line_reports_missing_input_without_traceback(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "preprocess_data.py"),
            "--input",
            str(tmp_path / "nope"),
            "--output-prefix",
            str(tmp_path / "out"),
            "--tokenizer-type",
            "ByteLevelTokenizer",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 2
    assert (
        result.stderr
        == f"preprocess_data.py: error: no such file or directory: {tmp_path / 'nope'}\n"
    )


# GPT datasets


def test_gpt_dataset_samples_cover_the_prefix_in_order(stdlib_dataset, tmp_path):
    path_prefix, _ = stdlib_dataset
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=SEQUENCE_LENGTH,
        blend=([path_prefix], None),
        split="1,0,0",
        tokenizer=ByteLevelTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(tmp_path / "cache"),
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [16, None, None], lambda: True, config
    ).build()

    # One shuffled epoch over the documents, cut into windows of sequence_length + 1 tokens
    # that overlap by one token: tokens = window[:-1], labels = window[1:].
    indexed = IndexedDataset(path_prefix)
    stream = numpy.concatenate([indexed[int(doc)] for doc in train.document_index])
    assert valid is None and test is None
    assert len(train) == (len(stream) - 1) // SEQUENCE_LENGTH
    for position, sample_index in enumerate(numpy.argsort(train.shuffle_index)):
        sample = train[int(sample_index)]
        window = stream[position * SEQUENCE_LENGTH : (position + 1) * SEQUENCE_LENGTH + 1]
        assert sample["tokens"].tolist() == window[:-1].tolist()
        assert sample["labels"].tolist() == window[1:].tolist()
    cached = sorted(path.name.split("-", 1)[1] for path in (tmp_path / "cache").iterdir())
    assert cached == [
        f"GPTDataset-train-{name}"
        for name in (
            "description.txt",
            "document_index.npy",
            "sample_index.npy",
            "shuffle_index.npy",
        )
    ]


def test_mock_gpt_dataset_accepts_null_tokenizer():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=1000)
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=64,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [8, 8, 8], lambda: True, config
    ).build()
    tokens = numpy.concatenate([train[i]["tokens"].numpy() for i in range(8)])

    assert tokens.shape == (8 * 64,)
    assert tokens.max() == tokenizer.eod == tokenizer.vocab_size - 1
