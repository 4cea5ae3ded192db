"""``--elastic-profile-out``: measure the planner's cost profile on a real run.

Hooks time each part of the model for every micro-batch after the first iteration:

* forward: from the part's forward pre-hook to its forward hook;
* backward: from the moment the gradient of the part's output exists to the moment the gradient
  of its input does (tensor hooks, so the numbers are the autograd engine's own order);
* activation bytes: the tensors autograd saves during the part's forward (saved-tensor hooks),
  parameters excluded;
* parameter bytes: the part's parameters on this rank.

Parts are the transformer layers (by global layer number), the embedding and the "loss" part
(final norm, output layer and cross entropy). Each is measured on replica 0's tensor-parallel
rank 0 that holds it; medians over micro-batches go into the profile. Link speeds come from a
ping-pong between pipeline neighbours and an all-reduce over the data-parallel group. On an
accelerator every timestamp is taken after a device synchronisation.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks

from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.planner.profile import OpCost, Profile, ProfileConfig, save_profile

_BANDWIDTH_PROBE_BYTES = 4 << 20
_LINK_REPEATS = 10


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


def _parameter_bytes(modules) -> int:
    return sum(p.numel() * p.element_size() for m in modules if m is not None for p in m.parameters())


@dataclass
class _PartSamples:
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    activation_bytes: list[int] = field(default_factory=list)
    param_bytes: int = 0

    def cost(self) -> OpCost:
        median = lambda values: statistics.median(values) if values else 0.0  # noqa: E731
        return OpCost(forward_s=median(self.forward_s), backward_s=median(self.backward_s),
                      param_bytes=self.param_bytes,
                      activation_bytes=int(median(self.activation_bytes)))


class PartTimer:
    """Times one part of a model, spanning from ``start`` module to ``end`` module."""

    def __init__(self, profiler: "CostProfiler", samples: _PartSamples, start: torch.nn.Module,
                 end: torch.nn.Module, input_free_weight: torch.Tensor | None = None) -> None:
        """``input_free_weight``: for a part whose input needs no gradient (the embedding),
        its backward ends when this weight's gradient has been accumulated."""
        self.profiler, self.samples = profiler, samples
        self._saved: saved_tensors_hooks | None = None
        self._saved_bytes = 0
        self._started = 0.0
        self._backward_started: float | None = None
        start.register_forward_pre_hook(self._forward_begins, with_kwargs=True)
        end.register_forward_hook(self._forward_ends)
        if input_free_weight is not None:
            input_free_weight.register_post_accumulate_grad_hook(self._backward_ends)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # Count each storage once; weights (views of the parameter buffer) are not activations.
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.profiler.parameter_storages | self._seen_storages:
            self._seen_storages.add(storage.data_ptr())
            self._saved_bytes += storage.nbytes()
        return tensor

    def _forward_begins(self, module, args, kwargs) -> None:
        if not self.profiler.recording or not torch.is_grad_enabled():
            return
        self._started = self.profiler.now()
        self._saved_bytes = 0
        self._seen_storages: set[int] = set()
        self._saved = saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._saved.__enter__()
        part_input = _first_tensor(args) if args else kwargs.get("hidden_states")
        if part_input is not None and part_input.requires_grad:
            part_input.register_hook(self._backward_ends)

    def _forward_ends(self, module, args, output) -> None:
        if self._saved is None:
            return
        self._saved.__exit__(None, None, None)
        self._saved = None
        self.samples.forward_s.append(self.profiler.now() - self._started)
        self.samples.activation_bytes.append(self._saved_bytes)
        part_output = _first_tensor(output)
        if part_output is not None and part_output.requires_grad:
            part_output.register_hook(self._backward_begins)

    def _backward_begins(self, grad):
        self._backward_started = self.profiler.now()

    def _backward_ends(self, grad):
        if self._backward_started is not None:
            self.samples.backward_s.append(self.profiler.now() - self._backward_started)
            self._backward_started = None


class CostProfiler:
    """Attaches :class:`PartTimer` hooks to a rank's model chunks and writes the profile."""

    def __init__(self, chunks: list[torch.nn.Module], backend: DeviceBackend, measure: bool) -> None:
        self.backend = backend
        self.recording = False
        self.parameter_storages = {p.untyped_storage().data_ptr()
                                   for chunk in chunks for p in chunk.parameters()}
        self.layers: dict[int, _PartSamples] = defaultdict(_PartSamples)
        self.embedding: _PartSamples | None = None
        self.loss: _PartSamples | None = None
        if measure:
            for chunk in chunks:
                self._attach(chunk)

    def now(self) -> float:
        if self.backend.is_accelerator:
            self.backend.synchronize()
        return time.perf_counter()

    def _attach(self, chunk) -> None:
        for layer in chunk.decoder.layers:
            samples = self.layers[layer.layer_number - 1]
            samples.param_bytes = _parameter_bytes([layer])
            PartTimer(self, samples, layer, layer)
        if chunk.pre_process:
            self.embedding = _PartSamples(param_bytes=_parameter_bytes([chunk.embedding]))
            PartTimer(self, self.embedding, chunk.embedding, chunk.embedding,
                      input_free_weight=chunk.embedding.word_embeddings.weight)
        if chunk.post_process:
            norm = chunk.decoder.final_layernorm
            self.loss = _PartSamples(param_bytes=_parameter_bytes([norm, chunk.output_layer]))
            PartTimer(self, self.loss, norm, chunk)

    def local_costs(self) -> dict:
        return {
            "layers": {index: s.cost() for index, s in self.layers.items()},
            "embedding": self.embedding.cost() if self.embedding else None,
            "loss": self.loss.cost() if self.loss else None,
        }


def _p2p_latency(group: dist.ProcessGroup, backend: DeviceBackend) -> float:
    """Half the median round trip of a one-element message between group ranks 0 and 1, the
    device synchronised before each clock is read (the collectives of an accelerator return
    before they end)."""
    if group.size() < 2 or group.rank() > 1:
        return 0.0
    peer = dist.get_global_rank(group, 1 - group.rank())
    message = torch.zeros(1, device=backend.device())
    trips = []
    for _ in range(_LINK_REPEATS):
        backend.synchronize()
        start = time.perf_counter()
        if group.rank() == 0:
            dist.send(message, peer, group=group)
            dist.recv(message, peer, group=group)
        else:
            dist.recv(message, peer, group=group)
            dist.send(message, peer, group=group)
        backend.synchronize()
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2


def _allreduce_bandwidth(group: dist.ProcessGroup, backend: DeviceBackend) -> float:
    """Bus bandwidth of an all-reduce over ``group`` (a local copy's for a one-rank group), the
    device synchronised before each clock is read."""
    buffer = torch.ones(_BANDWIDTH_PROBE_BYTES // 4, device=backend.device())
    times = []
    for _ in range(_LINK_REPEATS):
        backend.synchronize()
        start = time.perf_counter()
        if group.size() > 1:
            dist.all_reduce(buffer, group=group)
        else:
            buffer.copy_(buffer.flip(0))
        backend.synchronize()
        times.append(time.perf_counter() - start)
    ranks = group.size()
    traffic = 2 * (ranks - 1) / ranks * _BANDWIDTH_PROBE_BYTES if ranks > 1 else _BANDWIDTH_PROBE_BYTES
    return traffic / statistics.median(times)


def write_profile(path: str, profiler: CostProfiler, pg_collection, args, device_name: str) -> None:
    """Gather every rank's measurements and write the profile from rank 0 (collective)."""
    latency = _p2p_latency(pg_collection.pp, profiler.backend)
    bandwidth = _allreduce_bandwidth(pg_collection.dp, profiler.backend)
    measured = profiler.local_costs() if (pg_collection.tp.rank() == 0
                                          and pg_collection.dp.rank() == 0) else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (measured, latency, bandwidth))
    if dist.get_rank() != 0:
        return
    layers, embedding, loss = {}, None, None
    for costs, _, _ in gathered:
        if costs is None:
            continue
        layers.update(costs["layers"])
        embedding = embedding or costs["embedding"]
        loss = loss or costs["loss"]
    latencies = [lat for _, lat, _ in gathered if lat > 0]
    profile = Profile(
        device=device_name,
        config=ProfileConfig(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length,
            params_dtype_bytes=4 if not (args.bf16 or args.fp16) else 2,
            notes={"pipeline_model_parallel_size": args.pipeline_model_parallel_size,
                   "hidden_size": args.hidden_size, "num_layers": args.num_layers},
        ),
        layers=tuple(layers[i] for i in sorted(layers)),
        embedding=embedding,
        loss=loss,
        p2p_latency_s=statistics.median(latencies) if latencies else 0.0,
        dp_bandwidth_bytes_per_s=statistics.median(bw for _, _, bw in gathered),
    )
    save_profile(profile, path)


def device_description(backend: DeviceBackend) -> str:
    if backend.name == "cuda":
        return torch.cuda.get_device_name()
    if backend.name == "npu":
        return f"npu {torch.npu.get_device_name()}"
    return f"cpu ({torch.get_num_threads()} thread per rank)"
