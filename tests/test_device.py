"""Device backends, and the CPU compatibility patches kept narrow and reversible."""

import os

import pytest
import torch

from megatron_elaswave.device import (
    DEVICE_ENV_VAR,
    DeviceBackend,
    DeviceUnavailableError,
    resolve_device_backend,
)
from megatron_elaswave.patches import compatibility_registry


def test_auto_detection_and_override(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV_VAR, raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device_backend().name == expected
    monkeypatch.setenv(DEVICE_ENV_VAR, "cpu")
    backend = resolve_device_backend()
    assert (backend.name, backend.dist_backend) == ("cpu", "gloo")
    assert resolve_device_backend("auto").name == expected  # an explicit choice beats the env


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_devices_are_refused_not_replaced():
    with pytest.raises(DeviceUnavailableError, match="'cuda' is not available"):
        resolve_device_backend("cuda")
    with pytest.raises(DeviceUnavailableError, match="torch-npu"):
        resolve_device_backend("npu")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device_backend("tpu")


def test_backend_collectives_and_dtypes():
    assert DeviceBackend("cuda").dist_backend == "nccl"
    assert DeviceBackend("npu").dist_backend == "hccl"
    cpu = DeviceBackend("cpu")
    assert cpu.supports_dtype(torch.float32) and not cpu.supports_dtype(torch.bfloat16)


@pytest.fixture
def cpu_compat():
    registry = compatibility_registry(DeviceBackend("cpu"))
    registry.apply()
    yield registry
    registry.remove()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility is for machines without CUDA")
def test_compat_is_narrow(cpu_compat):
    from megatron.core.pipeline_parallel import schedules

    assert torch.cuda.current_device() == torch.device("cpu")
    assert schedules.torch.zeros(2, device="cuda").device.type == "cpu"
    # Only Megatron's modules with literal "cuda" see the mapping; everyone else gets torch.
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")
    assert torch.ones(1).type() == "torch.FloatTensor"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility is for machines without CUDA")
def test_compat_removal_restores_torch():
    true_current_device = torch.cuda.current_device
    registry = compatibility_registry(DeviceBackend("cpu"))
    registry.apply()
    from megatron.core.pipeline_parallel import schedules

    assert schedules.torch is not torch
    registry.remove()
    assert torch.cuda.current_device is true_current_device and schedules.torch is torch


def test_tracker_seeds_each_tensor_parallel_rank_for_real(cpu_compat):
    """Megatron's RNG tracker must give TP ranks different model-parallel streams and the same
    data-parallel stream: a no-op seed would make every TP rank's dropout identical."""
    from megatron.core.tensor_parallel import random as megatron_random

    def draws(tp_rank):
        megatron_random.model_parallel_cuda_manual_seed(
            1234, tp_rank=tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=True)
        tracker = megatron_random.get_cuda_rng_tracker()
        with tracker.fork("model-parallel-rng"):
            model_parallel = torch.rand(4)
        with tracker.fork("data-parallel-rng"):
            data_parallel = torch.rand(4)
        return model_parallel, data_parallel

    mp0, dp0 = draws(0)
    mp1, dp1 = draws(1)
    assert not torch.equal(mp0, mp1)
    assert torch.equal(dp0, dp1)


@pytest.mark.parametrize("name, variable, given, kept, said", [
    ("cuda", "TORCH_NCCL_ASYNC_ERROR_HANDLING", None, "2", False),
    ("cuda", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", "2", True),   # torch's default tears down
    ("cuda", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "2", True),
    ("cuda", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "0", "0", False),  # no handling leaves it alive
    ("npu", "HCCL_ASYNC_ERROR_HANDLING", None, "0", False),
    ("npu", "HCCL_ASYNC_ERROR_HANDLING", "1", "0", True),
])
def test_an_elastic_job_keeps_the_collective_library_from_ending_its_survivors(
        monkeypatch, name, variable, given, kept, said):
    """The NCCL (and HCCL) watchdog ends a process whose communicator saw a peer fail unless
    told otherwise: every survivor of a failure, which must live to recover."""
    if given is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, given)
    note = DeviceBackend(name).keep_survivors_alive()
    assert os.environ[variable] == kept
    assert (note is not None) == said
    if said:
        assert note == f"{variable}={given} would end the survivors of a failure; --elastic sets {variable}={kept}"


def test_a_cpu_job_has_no_watchdog_to_tell(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert DeviceBackend("cpu").keep_survivors_alive() is None
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
