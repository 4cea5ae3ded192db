"""Chunks that reduce over one data-parallel group share one bucket group: one coalesced
reduce-scatter of their gradients and one coalesced all-gather of their parameters per step.

The step's results are compared with the plain megatron-core path in ``test_plain_oracle.py``
(interleaved ZeRO, two chunks per rank over one group of two); here the collectives are
counted."""

from unittest import mock

import pytest
import torch

from megatron_elaswave.patches.distributed_data_parallel import share_bucket_groups
from test_distrib_optimizer_fix import one_rank_megatron, tiny_gpt  # noqa: F401  (fixture)


@pytest.fixture
def collectives(monkeypatch):
    """The data-parallel collectives of the bucket groups, in order (``.mock_calls``): ``block``
    for each coalescing block, then ``reduce_scatter`` or ``all_gather`` for each call in it."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    calls = mock.Mock()
    for attribute, name in (("_coalescing_manager", "block"),
                            ("dist_reduce_scatter_func", "reduce_scatter"),
                            ("dist_all_gather_func", "all_gather")):
        recorded = mock.Mock(wraps=getattr(buffers, attribute))
        calls.attach_mock(recorded, name)
        monkeypatch.setattr(buffers, attribute, recorded)
    return calls


def names(calls: mock.Mock) -> list[str]:
    return [name for name, _, _ in calls.mock_calls]


def test_chunks_over_one_group_reduce_and_gather_in_one_collective_each(one_rank_megatron,  # noqa: F811
                                                                         collectives):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               grad_reduce_in_fp32=True)
    chunks = [tiny_gpt(ddp_config), tiny_gpt(ddp_config)]
    buckets = [bucket for chunk in chunks for group in chunk.bucket_groups
               for bucket in group.buckets]
    optimizer = ChainedOptimizer([
        inner for chunk in chunks for inner in get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [chunk],
            use_gloo_process_groups=False).chained_optimizers])

    share_bucket_groups(chunks)

    assert chunks[0].bucket_groups == []
    [shared] = chunks[1].bucket_groups
    assert shared.buckets == buckets
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)
    for chunk in chunks:
        chunk.zero_grad_buffer()
        chunk(tokens, positions, None, labels=tokens).mean().backward()
    for chunk in chunks:
        chunk.finish_grad_sync()
    assert names(collectives) == ["block", "reduce_scatter", "reduce_scatter"]
    before = [p.detach().clone() for chunk in chunks for p in chunk.parameters()]
    collectives.reset_mock()
    optimizer.step()
    assert names(collectives) == ["block", "all_gather", "all_gather"]
    after = [p.detach() for chunk in chunks for p in chunk.parameters()]
    assert all(not torch.equal(b, a) for b, a in zip(before, after))  # every chunk stepped


def test_chunks_that_overlap_their_gradient_reduction_keep_their_buckets(one_rank_megatron):  # noqa: F811
    from megatron.core.distributed import DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               overlap_grad_reduce=True)
    with pytest.raises(ValueError, match="reduce their gradients at the step"):
        share_bucket_groups([tiny_gpt(ddp_config), tiny_gpt(ddp_config)])
