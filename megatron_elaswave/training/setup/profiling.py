"""``--elastic-profile-out``: measure the planner's cost profile on a real run.

Hooks time each part of the model for every micro-batch after the first iteration:

* forward: from the part's forward pre-hook to its forward hook;
* backward: from the moment the gradient of the part's output exists to the moment the gradient
  of its input does (tensor hooks, so the numbers are the autograd engine's own order);
* activation bytes: the tensors autograd saves during the part's forward (saved-tensor hooks),
  parameters excluded;
* parameter bytes: the part's parameters on this rank.

Parts are the transformer layers (by global layer number), the embedding and the "loss" part
(final norm, output layer and cross entropy; with ``--mtp-num-layers``, the multi-token
prediction layers and the last stage's copy of the embedding too). Each is measured on replica 0's tensor-parallel
rank 0 that holds it; medians over micro-batches go into the profile. Link speeds come from a
ping-pong between pipeline neighbours and an all-reduce over the data-parallel group. On an
accelerator every timestamp is taken after a device synchronisation.

An MoE layer is marked as one in the profile (its ``moe`` object): the bytes of its routed
experts' parameters on the rank, and what its dispatch sends per micro-batch (top-k x the rank's
tokens x hidden size x bytes per element). Its forward's two exchanges, the dispatcher's dispatch
and combine (all-to-alls, or the all-gather and reduce-scatter of the allgather dispatcher), are
timed apart, and their median is taken out of the layer's forward time and, as the backward runs
the same exchanges in reverse (not timed: they run inside autograd), out of its backward time. A
peer that lags makes a forward's exchange wait longer than the backward's; where that leaves the
backward less than the forward's compute, it is taken to cost the forward's compute, a lower bound
(a layer's backward does at least its forward's arithmetic).
The profile's ``expert_bandwidth_bytes_per_s`` is the bandwidth at which the cost model's
all-to-all (two exchanges of latency + bytes sent / bandwidth) takes that median, so the planner
puts back what was taken out at the measured expert-parallel size.
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
from megatron_elaswave.planner.profile import ExpertCost, OpCost, Profile, ProfileConfig, save_profile

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


def _median(values) -> float:
    return statistics.median(values) if values else 0.0


@dataclass
class _PartSamples:
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    activation_bytes: list[int] = field(default_factory=list)
    param_bytes: int = 0
    expert_param_bytes: int | None = None
    """Of ``param_bytes``, the routed experts' in an MoE layer; ``None`` in a dense part."""
    all_to_all_s: list[float] = field(default_factory=list)
    """An MoE layer's forward dispatch plus combine, one sample per micro-batch."""

    def cost(self, all_to_all_bytes: int) -> OpCost:
        """The medians, an MoE layer's exchanges taken out of its forward and its backward
        (which sends ``all_to_all_bytes`` per dispatch)."""
        exchanges = _median(self.all_to_all_s)
        moe = None if self.expert_param_bytes is None else ExpertCost(self.expert_param_bytes,
                                                                      all_to_all_bytes)
        forward_s = max(0.0, _median(self.forward_s) - exchanges)
        backward_s = _median(self.backward_s)
        if exchanges:
            backward_s = max(forward_s, backward_s - exchanges)
        return OpCost(forward_s=forward_s, backward_s=backward_s,
                      param_bytes=self.param_bytes,
                      activation_bytes=int(_median(self.activation_bytes)), moe=moe)


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


class ExchangeTimer:
    """Times the exchanges of an MoE layer's forward, its dispatch and its combine, by wrapping
    the layer's methods: one sample, their sum, per micro-batch."""

    def __init__(self, profiler: "CostProfiler", samples: _PartSamples, moe_layer: torch.nn.Module) -> None:
        self.profiler, self.samples = profiler, samples
        self._dispatch_s = 0.0
        moe_layer.dispatch = self._timed(moe_layer.dispatch, completes_sample=False)
        moe_layer.combine = self._timed(moe_layer.combine, completes_sample=True)

    def _timed(self, exchange, *, completes_sample: bool):
        def timed(*args, **kwargs):
            if not self.profiler.recording or not torch.is_grad_enabled():
                return exchange(*args, **kwargs)
            started = self.profiler.now()
            result = exchange(*args, **kwargs)
            elapsed = self.profiler.now() - started
            if completes_sample:
                self.samples.all_to_all_s.append(self._dispatch_s + elapsed)
            else:
                self._dispatch_s = elapsed
            return result

        return timed


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
            if layer.is_moe_layer:
                samples.expert_param_bytes = _parameter_bytes([layer.mlp.experts])
                ExchangeTimer(self, samples, layer.mlp)
        if chunk.pre_process:
            self.embedding = _PartSamples(param_bytes=_parameter_bytes([chunk.embedding]))
            PartTimer(self, self.embedding, chunk.embedding, chunk.embedding,
                      input_free_weight=chunk.embedding.word_embeddings.weight)
        if chunk.post_process:
            # The loss part runs from the final norm to the end of the chunk: multi-token
            # prediction layers (and their copy of the embedding) included.
            norm = chunk.decoder.final_layernorm
            prediction = ([chunk.mtp] + ([] if chunk.pre_process else [chunk.embedding])
                          if getattr(chunk, "mtp_process", False) else [])
            self.loss = _PartSamples(param_bytes=_parameter_bytes([norm, chunk.output_layer,
                                                                   *prediction]))
            PartTimer(self, self.loss, norm, chunk)

    def local_costs(self, all_to_all_bytes: int) -> dict:
        """This rank's parts' costs (an MoE layer's dispatch sending ``all_to_all_bytes``), and
        the median forward exchanges of its MoE layers."""
        return {
            "layers": {index: s.cost(all_to_all_bytes) for index, s in self.layers.items()},
            "embedding": self.embedding.cost(0) if self.embedding else None,
            "loss": self.loss.cost(0) if self.loss else None,
            "exchanges_s": [_median(s.all_to_all_s) for s in self.layers.values() if s.all_to_all_s],
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


def _dispatch_bytes(args) -> int:
    """What one rank sends in an MoE layer's dispatch of one micro-batch: each of its tokens
    (``1 / TP`` of the micro-batch's, with sequence parallelism) to its top-k experts."""
    element_bytes = 2 if (args.bf16 or args.fp16) else 4
    tokens = args.micro_batch_size * args.seq_length // args.tensor_model_parallel_size
    return args.moe_router_topk * tokens * args.hidden_size * element_bytes


def _expert_bandwidth(exchanges_s: list[float], dispatch_bytes: int, expert_parallel_size: int,
                      latency_s: float) -> float | None:
    """The bandwidth at which the cost model's dispatch plus combine (each ``latency + bytes sent
    / bandwidth``, a rank keeping ``1 / EP`` of its bytes) take the median measured time; ``None``
    without expert parallelism, or when the exchanges took no longer than their latency."""
    if expert_parallel_size == 1 or not exchanges_s:
        return None
    per_exchange = statistics.median(exchanges_s) / 2 - latency_s
    if per_exchange <= 0:
        return None
    return dispatch_bytes * (expert_parallel_size - 1) / expert_parallel_size / per_exchange


def _config(args) -> ProfileConfig:
    """The measured configuration, an MoE model's experts and router included."""
    notes = {"pipeline_model_parallel_size": args.pipeline_model_parallel_size,
             "hidden_size": args.hidden_size, "num_layers": args.num_layers}
    experts = {}
    if args.num_experts:
        notes.update(moe_router_topk=args.moe_router_topk,
                     moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                     moe_token_dispatcher_type=args.moe_token_dispatcher_type)
        experts = dict(num_experts=args.num_experts,
                       expert_model_parallel_size=args.expert_model_parallel_size,
                       expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    return ProfileConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        params_dtype_bytes=4 if not (args.bf16 or args.fp16) else 2,
        **experts,
        notes=notes,
    )


def write_profile(path: str, profiler: CostProfiler, pg_collection, args, device_name: str) -> None:
    """Gather every rank's measurements and write the profile from rank 0 (collective)."""
    latency = _p2p_latency(pg_collection.pp, profiler.backend)
    bandwidth = _allreduce_bandwidth(pg_collection.dp, profiler.backend)
    dispatch_bytes = _dispatch_bytes(args) if args.num_experts else 0
    measured = profiler.local_costs(dispatch_bytes) if (pg_collection.tp.rank() == 0
                                                        and pg_collection.dp.rank() == 0) else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (measured, latency, bandwidth))
    if dist.get_rank() != 0:
        return
    layers, embedding, loss, exchanges = {}, None, None, []
    for costs, _, _ in gathered:
        if costs is None:
            continue
        layers.update(costs["layers"])
        embedding = embedding or costs["embedding"]
        loss = loss or costs["loss"]
        exchanges += costs["exchanges_s"]
    latencies = [lat for _, lat, _ in gathered if lat > 0]
    p2p_latency = statistics.median(latencies) if latencies else 0.0
    profile = Profile(
        device=device_name,
        config=_config(args),
        layers=tuple(layers[i] for i in sorted(layers)),
        embedding=embedding,
        loss=loss,
        p2p_latency_s=p2p_latency,
        dp_bandwidth_bytes_per_s=statistics.median(bw for _, _, bw in gathered),
        expert_bandwidth_bytes_per_s=_expert_bandwidth(exchanges, dispatch_bytes,
                                                       args.expert_model_parallel_size, p2p_latency),
    )
    save_profile(profile, path)


def device_description(backend: DeviceBackend) -> str:
    if backend.name == "cuda":
        return torch.cuda.get_device_name()
    if backend.name == "npu":
        return f"npu {torch.npu.get_device_name()}"
    return f"cpu ({torch.get_num_threads()} thread per rank)"
