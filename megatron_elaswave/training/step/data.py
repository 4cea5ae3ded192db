"""Training data as micro-batches with global ids.

The global batch of an iteration is the ordered list of micro-batches ``0 .. M-1``; micro-batch
``j`` holds dataset samples ``consumed + j*mbs .. consumed + (j+1)*mbs - 1``, where ``consumed``
counts the samples of all earlier iterations. A replica runs whichever micro-batch ids the
layout gives it, so the samples of a step do not depend on how many replicas there are or how
they are split. (The failure-free layout deals them round-robin, as Megatron-LM's sampler does.)

Datasets are megatron-core's ``GPTDataset`` on Megatron's indexed ``.bin``/``.idx`` format (one
prefix, or a blend: ``--data-path W1 P1 W2 P2 ...`` as in Megatron-LM, megatron-core's
``BlendedDataset`` over them), or ``MockGPTDataset`` for ``--mock-data``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import get_blend_from_list

from megatron_elaswave.tokenizer import build_tokenizer


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron-LM's padding: a multiple of ``divisible_by x tp_size``."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


class DataError(ValueError):
    """Data that cannot serve the run; the message is one line."""


def data_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """The prefixes and weights of ``--data-path``: one prefix, or ``W1 P1 W2 P2 ...`` (Megatron-LM's
    blend; the weights are normalised by megatron-core). Raises :class:`DataError`."""
    try:
        return get_blend_from_list(data_path)
    except (ValueError, AssertionError):
        raise DataError(f"--data-path {' '.join(data_path)}: give one prefix, or weights and "
                        "prefixes in pairs (W1 P1 W2 P2 ...)") from None


def _require_documents(config: GPTDatasetConfig, sizes: list[int | None], split: str) -> None:
    """Megatron's sampler loops forever on a split without documents: refuse it up front, for
    every prefix of a blend."""
    for prefix in config.blend[0]:
        documents = IndexedDataset(prefix, mmap=config.mmap_bin_files).document_indices.shape[0] - 1
        for name, bounds, size in zip(("training", "validation", "test"), config.split_matrix,
                                      sizes):
            if bounds is None or not size:
                continue
            first, end = (int(round(bound * documents)) for bound in bounds)
            if end <= first:
                raise DataError(
                    f"--split {split} leaves the {name} set of {prefix} ({documents} documents) "
                    "empty; give it a larger share or add data"
                )


def build_datasets(args: argparse.Namespace, tokenizer) -> tuple[GPTDataset, GPTDataset | None]:
    """The training dataset and, when the run evaluates, the validation dataset."""
    gbs = args.global_batch_size
    evaluations = args.train_iters // args.eval_interval
    train, valid, _ = gpt_datasets(
        args, tokenizer, [train_samples(args), evaluations * args.eval_iters * gbs or None, None])
    return train, valid


def train_samples(args: argparse.Namespace) -> int:
    """Samples the whole run trains on: ``--train-samples``, else ``--train-iters`` global batches
    (an upper bound while a batch-size ramp-up grows the batch)."""
    return getattr(args, "train_samples", None) or args.train_iters * args.global_batch_size


def gpt_datasets(args: argparse.Namespace, tokenizer, sizes: list[int | None]):
    """The training, validation and test datasets of ``sizes`` samples (``None``: not built)."""
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=data_blend(args.data_path) if args.data_path else None,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=getattr(args, "mmap_bin_files", True),
        tokenizer=tokenizer,
        reset_position_ids=getattr(args, "reset_position_ids", False),
        reset_attention_mask=getattr(args, "reset_attention_mask", False),
        eod_mask_loss=getattr(args, "eod_mask_loss", False),
        create_attention_mask=getattr(args, "create_attention_mask_in_dataloader", False),
    )
    if args.data_path:
        _require_documents(config, sizes, args.split)
        if config.blend[1] is not None:  # megatron-core builds a weighted blend for every split
            sizes = [size or 0 for size in sizes]
    dataset_class = MockGPTDataset if args.mock_data else GPTDataset
    datasets = BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, config).build()
    return tuple(dataset if size else None for dataset, size in zip(datasets, sizes))


def load_tokenizer(args: argparse.Namespace):
    try:
        return build_tokenizer(args.tokenizer_type, vocab_size=args.vocab_size)
    except ValueError as error:
        raise DataError(str(error)) from None


@dataclass
class MicrobatchSource:
    """Cuts a dataset into micro-batches addressed by ``(consumed samples, micro-batch id)``."""

    dataset: torch.utils.data.Dataset
    micro_batch_size: int

    def sample_ids(self, consumed_samples: int, microbatch_id: int) -> range:
        start = consumed_samples + microbatch_id * self.micro_batch_size
        return range(start, start + self.micro_batch_size)

    def batch(self, consumed_samples: int, microbatch_id: int) -> dict[str, torch.Tensor]:
        ids = self.sample_ids(consumed_samples, microbatch_id)
        samples = [self.dataset[i % len(self.dataset)] for i in ids]
        batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                 for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
                 if key in samples[0]}
        batch["sample_ids"] = torch.tensor(list(ids), dtype=torch.int64)
        return batch


@dataclass
class StepData:
    """The micro-batches one replica runs in one step, on the model's ``device``; remembers
    which samples it handed out. Each batch also carries its global ``microbatch_id``."""

    source: MicrobatchSource
    consumed_samples: int
    microbatch_ids: Sequence[int]
    device: torch.device = torch.device("cpu")
    served_sample_ids: dict[int, list[int]] = field(default_factory=dict)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for microbatch_id in self.microbatch_ids:
            batch = self.source.batch(self.consumed_samples, microbatch_id)
            self.served_sample_ids[microbatch_id] = batch.pop("sample_ids").tolist()
            batch = {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}
            batch["microbatch_id"] = microbatch_id
            yield batch


@dataclass
class MicrobatchIds:
    """What a stage without the first or last layer gets instead of :class:`StepData`: only the
    global id of each micro-batch, in the order it runs them (no data is loaded). Every stage
    needs it to key its dropout masks (``megatron_elaswave.runtime.dropout_rng``)."""

    microbatch_ids: Sequence[int]

    def __iter__(self) -> Iterator[dict[str, int]]:
        for microbatch_id in self.microbatch_ids:
            yield {"microbatch_id": microbatch_id}
