"""megatron-core 0.16's DistributedOptimizer.load_state_dict shares one Adam ``step`` tensor
across parameters; the fix gives each its own. The test shows the bug without the fix."""

import datetime

import pytest
import torch
import torch.distributed as dist

from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.patches import PatchRegistry, device_compat, distrib_optimizer, tensor_parallel_random


@pytest.fixture
def one_rank_megatron():
    backend = DeviceBackend("cpu")
    compat = PatchRegistry()
    device_compat.register(compat, backend)
    tensor_parallel_random.register(compat, backend)
    compat.apply()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    compat.remove()


def tiny_gpt(ddp_config):
    """A one-layer GPT (vocabulary 32, sequence 8) in Megatron's ``DistributedDataParallel``."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(7, force_reset_rng=True)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=32, max_sequence_length=8)
    return DistributedDataParallel(config, ddp_config, gpt)


def build_and_train(steps):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = tiny_gpt(DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                   grad_reduce_in_fp32=True))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [model],
        use_gloo_process_groups=False)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)

    def step():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(tokens, positions, None, labels=tokens).mean().backward()
        model.finish_grad_sync()
        optimizer.step()

    for _ in range(steps):
        step()
    return optimizer, step


def adam_steps(optimizer):
    inner = optimizer.chained_optimizers[0].optimizer
    return [float(state["step"]) for state in inner.state.values()]


def test_loaded_adam_step_advances_once_per_iteration(one_rank_megatron):
    trained, _ = build_and_train(steps=2)
    saved = trained.state_dict()

    buggy, step = build_and_train(steps=0)
    buggy.load_state_dict(saved)
    step()
    steps = adam_steps(buggy)
    assert len(steps) > 1 and max(steps) > 3.0, "megatron-core fixed the shared step: drop the patch"

    fix = PatchRegistry()
    distrib_optimizer.register(fix)
    fix.apply()
    try:
        fixed, step = build_and_train(steps=0)
        fixed.load_state_dict(saved)
        step()
        assert adam_steps(fixed) == [3.0] * len(steps)
    finally:
        fix.remove()


def test_a_fresh_optimizers_state_dict_holds_a_step(one_rank_megatron):
    """Before its first step a distributed optimizer's torch Adam holds no state, and
    ``state_dict`` (which ``sharded_state_dict``, so every checkpoint load, calls first) asserts
    one ``step``; with the fix the state is allocated at step 0 and the first step is exact."""
    fresh, _ = build_and_train(steps=0)
    with pytest.raises(AssertionError):
        fresh.chained_optimizers[0].state_dict()

    fix = PatchRegistry()
    distrib_optimizer.register(fix)
    fix.apply()
    try:
        reference, _ = build_and_train(steps=1)
        fixed, step = build_and_train(steps=0)
        groups = fixed.chained_optimizers[0].state_dict()["optimizer"]["param_groups"]
        assert {group["step"] for group in groups} == {0.0}
        step()
        for mine, theirs in zip(fixed.chained_optimizers[0].optimizer.param_groups,
                                reference.chained_optimizers[0].optimizer.param_groups):
            for a, b in zip(mine["params"], theirs["params"]):
                assert torch.equal(a, b)
    finally:
        fix.remove()
