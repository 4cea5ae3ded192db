"""The cost profile the planner and the simulator are calibrated with.

A profile records, for one training configuration measured on one device, what each transformer
layer costs per micro-batch (forward and backward time, parameter bytes, activation bytes kept for
backward), what the embedding and the output layer with the loss cost, and how fast the links are.
``pretrain_gpt.py --elastic-profile-out FILE`` writes one from a real run; :func:`synthetic_profile`
builds one from model dimensions and a device's peak throughput when no measurement exists.

JSON format (version 1); all times in seconds, all sizes in bytes, all values per rank (one
tensor-parallel shard) at the measured configuration::

    {
      "version": 1,
      "device": "NVIDIA H100 80GB HBM3",          # free text, for the record
      "config": {                                 # the configuration the numbers were measured at
        "tensor_model_parallel_size": 1,          # required, >= 1
        "micro_batch_size": 1,                    # required, >= 1
        "seq_length": 4096,                       # required, >= 1
        "params_dtype_bytes": 2,                  # optional, default 2 (bf16); 4 for fp32
        "num_experts": 64,                        # required with MoE layers, absent without
        "expert_model_parallel_size": 8,          # optional, default 1
        "expert_tensor_parallel_size": 1,         # optional, default 1
        ...                                       # any other keys are kept as notes
      },
      "layers": [                                 # one entry per transformer layer, in order
        {"forward_s": 0.011, "backward_s": 0.022,
         "param_bytes": 50331648, "activation_bytes": 268435456},
        {"forward_s": 0.015, "backward_s": 0.030,  # an MoE layer: all-to-alls excluded
         "param_bytes": 251658240, "activation_bytes": 402653184,
         "moe": {"expert_param_bytes": 201326592, # its routed experts on this rank
                 "all_to_all_bytes": 33554432}},  # one dispatch of one micro-batch
        ...
      ],
      "embedding": {...same four keys...},        # word (+ position) embedding, first stage
      "loss": {...same four keys...},             # final norm, output layer and loss, last stage
      "p2p_latency_s": 2e-05,                     # one pipeline send, zero bytes
      "p2p_bandwidth_bytes_per_s": 2.5e10,        # optional, default dp_bandwidth_bytes_per_s
      "expert_bandwidth_bytes_per_s": 2.5e10,     # optional, default dp_bandwidth_bytes_per_s:
                                                  #   the all-to-alls over the expert-parallel group
      "dp_bandwidth_bytes_per_s": 2.5e10,         # per-rank bandwidth of data-parallel collectives
      "device_memory_bytes": 68719476736,         # optional, null: no memory cap
      "compute_bound_fraction": 0.85,             # optional, default 0.85: share of layer time
                                                  #   that scales with the clock (DVFS model)
      "pipeline_message_bytes": 16777216          # optional, default embedding.activation_bytes:
    }                                             #   bytes of one pipeline send (hidden states)

``activation_bytes`` is what one micro-batch leaves in memory for the backward pass of that layer.
A layer with a ``moe`` object is a mixture-of-experts layer: ``expert_param_bytes`` are its routed
experts' parameters on the rank (``num_experts / expert_model_parallel_size`` experts, each cut
over ``expert_tensor_parallel_size`` ranks), included in ``param_bytes``; ``all_to_all_bytes`` is
what the rank sends in one dispatch of one micro-batch (top-k x its tokens x hidden size x bytes
per element; the combine sends as many back). Its ``forward_s`` and ``backward_s`` exclude the
all-to-alls, which the cost model adds from these bytes and the links (router and expert compute
are included). When a job runs at another tensor-parallel size or micro-batch size than the profile was measured
at, :mod:`megatron_elaswave.planner.cost` scales times and activations linearly in
``micro_batch_size / tensor_model_parallel_size`` and parameter bytes in
``1 / tensor_model_parallel_size``, ``all_to_all_bytes`` like activations, ``expert_param_bytes``
in ``1 / (expert_model_parallel_size * expert_tensor_parallel_size)``; the job's sequence length is
the profile's. ``version`` must be 1; unknown top-level keys are ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_elaswave.layout import ExpertParallelism

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file or object that does not follow the documented format."""


def _number(value: Any, where: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ProfileError(f"{where} must be {'positive' if positive else 'non-negative'}, got {value!r}")
    return float(value)


def _integer(value: Any, where: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ProfileError(f"{where} must be an integer, got {value!r}")
    if value < minimum:
        raise ProfileError(f"{where} must be >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class ExpertCost:
    """What the routed experts of one MoE layer add on one rank, beyond a layer's four numbers."""

    expert_param_bytes: int
    """Bytes of the routed experts' parameters on this rank (part of the layer's ``param_bytes``)."""
    all_to_all_bytes: int
    """Bytes this rank sends in the dispatch of one micro-batch (the combine sends as many back):
    top-k x its tokens x hidden size x bytes per element."""

    def __post_init__(self) -> None:
        _integer(self.expert_param_bytes, "expert_param_bytes")
        _integer(self.all_to_all_bytes, "all_to_all_bytes")

    @classmethod
    def from_json(cls, record: Any, where: str) -> "ExpertCost":
        if not isinstance(record, dict):
            raise ProfileError(f"{where} must be an object, got {type(record).__name__}")
        missing = [k for k in ("expert_param_bytes", "all_to_all_bytes") if k not in record]
        if missing:
            raise ProfileError(f"{where} is missing {', '.join(missing)}")
        return cls(*(_integer(record[k], f"{where}.{k}")
                     for k in ("expert_param_bytes", "all_to_all_bytes")))


@dataclass(frozen=True)
class OpCost:
    """What one part of the model costs for one micro-batch on one rank."""

    forward_s: float
    """Forward time of one micro-batch, seconds."""
    backward_s: float
    """Backward time of one micro-batch (input and weight gradients), seconds."""
    param_bytes: int
    """Bytes of this part's parameters on one tensor-parallel rank, in the parameter dtype."""
    activation_bytes: int
    """Bytes one micro-batch keeps alive from this part's forward until its backward."""
    moe: ExpertCost | None = None
    """The routed experts of an MoE layer (its times then exclude the all-to-alls); ``None`` for
    a dense part."""

    def __post_init__(self) -> None:
        _number(self.forward_s, "forward_s")
        _number(self.backward_s, "backward_s")
        _integer(self.param_bytes, "param_bytes")
        _integer(self.activation_bytes, "activation_bytes")
        if self.moe is not None and self.moe.expert_param_bytes > self.param_bytes:
            raise ProfileError(f"moe.expert_param_bytes ({self.moe.expert_param_bytes}) exceeds "
                               f"param_bytes ({self.param_bytes})")

    @property
    def expert_param_bytes(self) -> int:
        return 0 if self.moe is None else self.moe.expert_param_bytes

    @classmethod
    def from_json(cls, record: Any, where: str) -> "OpCost":
        if not isinstance(record, dict):
            raise ProfileError(f"{where} must be an object, got {type(record).__name__}")
        missing = [
            k for k in ("forward_s", "backward_s", "param_bytes", "activation_bytes") if k not in record
        ]
        if missing:
            raise ProfileError(f"{where} is missing {', '.join(missing)}")
        values = dict(
            forward_s=_number(record["forward_s"], f"{where}.forward_s"),
            backward_s=_number(record["backward_s"], f"{where}.backward_s"),
            param_bytes=_integer(record["param_bytes"], f"{where}.param_bytes"),
            activation_bytes=_integer(record["activation_bytes"], f"{where}.activation_bytes"),
            moe=ExpertCost.from_json(record["moe"], f"{where}.moe") if "moe" in record else None,
        )
        try:  # every field is valid by now: what is left is how they relate
            return cls(**values)
        except ProfileError as error:
            raise ProfileError(f"{where}: {error}") from None

    def to_json(self) -> dict:
        record = {"forward_s": self.forward_s, "backward_s": self.backward_s,
                  "param_bytes": self.param_bytes, "activation_bytes": self.activation_bytes}
        if self.moe is not None:
            record["moe"] = asdict(self.moe)
        return record


_CONFIG_INTEGERS = ("tensor_model_parallel_size", "micro_batch_size", "seq_length",
                    "params_dtype_bytes", "num_experts", "expert_model_parallel_size",
                    "expert_tensor_parallel_size")
"""The typed keys of a profile's ``config``."""


@dataclass(frozen=True)
class ProfileConfig:
    """The training configuration a profile was measured at."""

    tensor_model_parallel_size: int
    """Tensor-parallel size of the measured run; values in the profile are per TP rank."""
    micro_batch_size: int
    """Samples per micro-batch in the measured run."""
    seq_length: int
    """Tokens per sample."""
    params_dtype_bytes: int = 2
    """Bytes per parameter element (2 for bf16/fp16, 4 for fp32)."""
    num_experts: int | None = None
    """Routed experts of every MoE layer; ``None`` for a dense model."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size of the measured run (MoE layers' ``expert_param_bytes`` are per rank)."""
    expert_tensor_parallel_size: int = 1
    """Expert tensor-parallel size of the measured run."""
    notes: dict = field(default_factory=dict)
    """Any other keys of the ``config`` object, kept for the record."""

    def __post_init__(self) -> None:
        for name in _CONFIG_INTEGERS:
            if name != "num_experts" or self.num_experts is not None:
                _integer(getattr(self, name), f"config.{name}", minimum=1)

    @property
    def expert_span(self) -> int:
        """Ranks of the measured run that held one copy of every expert between them."""
        return self.expert_model_parallel_size * self.expert_tensor_parallel_size

    @classmethod
    def from_json(cls, record: Any) -> "ProfileConfig":
        if not isinstance(record, dict):
            raise ProfileError("config must be an object")
        required = ("tensor_model_parallel_size", "micro_batch_size", "seq_length")
        missing = [k for k in required if k not in record]
        if missing:
            raise ProfileError(f"config is missing {', '.join(missing)}")
        return cls(
            **{k: _integer(record[k], f"config.{k}", minimum=1)
               for k in _CONFIG_INTEGERS if k in record},
            notes={k: v for k, v in record.items() if k not in _CONFIG_INTEGERS},
        )

    def to_json(self) -> dict:
        """The ``config`` object; of the expert keys, those that differ from their defaults."""
        record = {k: v for k, v in asdict(self).items() if k != "notes"}
        if self.num_experts is None:
            del record["num_experts"]
        for key in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
            if record[key] == 1:
                del record[key]
        record.update(self.notes)
        return record


@dataclass(frozen=True)
class Profile:
    """Per-layer costs and link speeds of one measured (or synthetic) configuration."""

    device: str
    """Device the profile was measured on (free text)."""
    config: ProfileConfig
    """Configuration the numbers were measured at."""
    layers: tuple[OpCost, ...]
    """One entry per transformer layer, in layer order."""
    embedding: OpCost
    """Embedding cost, paid by the first pipeline stage."""
    loss: OpCost
    """Final norm, output layer and loss cost, paid by the last pipeline stage."""
    p2p_latency_s: float
    """Latency of one pipeline send/receive, seconds."""
    dp_bandwidth_bytes_per_s: float
    """Per-rank bandwidth of data-parallel collectives and of migration copies, bytes/s."""
    p2p_bandwidth_bytes_per_s: float | None = None
    """Bandwidth of pipeline sends, bytes/s; ``None`` means ``dp_bandwidth_bytes_per_s``."""
    device_memory_bytes: int | None = None
    """Usable memory per device, bytes; ``None`` means no memory cap."""
    compute_bound_fraction: float = 0.85
    """Share of forward/backward time that scales with the clock (the rest is memory or
    communication bound and does not)."""
    pipeline_message_bytes: int | None = None
    """Bytes of one pipeline send (the hidden states of one micro-batch); ``None`` means
    ``embedding.activation_bytes``, the embedding's output being exactly those hidden states."""
    expert_bandwidth_bytes_per_s: float | None = None
    """Per-rank bandwidth of the MoE all-to-alls over the expert-parallel group, bytes/s;
    ``None`` means ``dp_bandwidth_bytes_per_s``."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ProfileError("layers must list at least one transformer layer")
        _number(self.p2p_latency_s, "p2p_latency_s")
        _number(self.dp_bandwidth_bytes_per_s, "dp_bandwidth_bytes_per_s", positive=True)
        if self.p2p_bandwidth_bytes_per_s is not None:
            _number(self.p2p_bandwidth_bytes_per_s, "p2p_bandwidth_bytes_per_s", positive=True)
        if self.device_memory_bytes is not None:
            _integer(self.device_memory_bytes, "device_memory_bytes", minimum=1)
        if self.pipeline_message_bytes is not None:
            _integer(self.pipeline_message_bytes, "pipeline_message_bytes")
        if self.expert_bandwidth_bytes_per_s is not None:
            _number(self.expert_bandwidth_bytes_per_s, "expert_bandwidth_bytes_per_s", positive=True)
        fraction = _number(self.compute_bound_fraction, "compute_bound_fraction")
        if fraction > 1:
            raise ProfileError(f"compute_bound_fraction must be in [0, 1], got {fraction}")
        self._check_experts()

    def _check_experts(self) -> None:
        """MoE layers only where the config names its experts, and only among the layers."""
        if self.embedding.moe is not None or self.loss.moe is not None:
            raise ProfileError("only layers can be MoE layers, not the embedding or the loss")
        has_moe = any(layer.moe is not None for layer in self.layers)
        if has_moe != (self.config.num_experts is not None):
            raise ProfileError("config.num_experts must be given exactly when a layer has 'moe'")
        if has_moe and self.config.num_experts % self.config.expert_model_parallel_size:
            raise ProfileError(f"config.num_experts ({self.config.num_experts}) is not divisible "
                               f"by config.expert_model_parallel_size "
                               f"({self.config.expert_model_parallel_size})")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def p2p_bandwidth(self) -> float:
        return self.p2p_bandwidth_bytes_per_s or self.dp_bandwidth_bytes_per_s

    @property
    def expert_bandwidth(self) -> float:
        return self.expert_bandwidth_bytes_per_s or self.dp_bandwidth_bytes_per_s

    @property
    def is_moe(self) -> bool:
        """Whether any layer is an MoE layer."""
        return self.config.num_experts is not None

    @property
    def pipeline_message(self) -> int:
        if self.pipeline_message_bytes is None:
            return self.embedding.activation_bytes
        return self.pipeline_message_bytes

    @classmethod
    def from_json(cls, record: Any) -> "Profile":
        if not isinstance(record, dict):
            raise ProfileError("a profile must be a JSON object")
        version = record.get("version")
        if version != PROFILE_VERSION:
            raise ProfileError(f"unsupported profile version {version!r} (expected {PROFILE_VERSION})")
        for key in ("config", "layers", "embedding", "loss", "p2p_latency_s", "dp_bandwidth_bytes_per_s"):
            if key not in record:
                raise ProfileError(f"profile is missing {key!r}")
        if not isinstance(record["layers"], list):
            raise ProfileError("layers must be a list")
        optional = {}
        for key in (
            "p2p_bandwidth_bytes_per_s",
            "device_memory_bytes",
            "compute_bound_fraction",
            "pipeline_message_bytes",
            "expert_bandwidth_bytes_per_s",
        ):
            if record.get(key) is not None:
                optional[key] = record[key]
        return cls(
            device=str(record.get("device", "unknown")),
            config=ProfileConfig.from_json(record["config"]),
            layers=tuple(OpCost.from_json(r, f"layers[{i}]") for i, r in enumerate(record["layers"])),
            embedding=OpCost.from_json(record["embedding"], "embedding"),
            loss=OpCost.from_json(record["loss"], "loss"),
            p2p_latency_s=_number(record["p2p_latency_s"], "p2p_latency_s"),
            dp_bandwidth_bytes_per_s=_number(record["dp_bandwidth_bytes_per_s"], "dp_bandwidth_bytes_per_s"),
            **optional,
        )

    def to_json(self) -> dict:
        return {
            "version": PROFILE_VERSION,
            "device": self.device,
            "config": self.config.to_json(),
            "layers": [layer.to_json() for layer in self.layers],
            "embedding": self.embedding.to_json(),
            "loss": self.loss.to_json(),
            "p2p_latency_s": self.p2p_latency_s,
            "p2p_bandwidth_bytes_per_s": self.p2p_bandwidth_bytes_per_s,
            "dp_bandwidth_bytes_per_s": self.dp_bandwidth_bytes_per_s,
            "device_memory_bytes": self.device_memory_bytes,
            "compute_bound_fraction": self.compute_bound_fraction,
            "pipeline_message_bytes": self.pipeline_message_bytes,
            "expert_bandwidth_bytes_per_s": self.expert_bandwidth_bytes_per_s,
        }


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile JSON file (format in this module's docstring).

    Raises :class:`ProfileError` naming the file and the offending field when the file is not
    valid JSON or does not follow the format.
    """
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ProfileError(f"{path}: not valid JSON ({error})") from None
    try:
        return Profile.from_json(record)
    except ProfileError as error:
        raise ProfileError(f"{path}: {error}") from None


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write a profile in the documented JSON format."""
    Path(path).write_text(json.dumps(profile.to_json(), indent=1) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class SyntheticMoE:
    """The mixture-of-experts layers of a :class:`SyntheticModel` (SwiGLU experts, no shared
    expert) and the expert sharding their costs are given for."""

    experts: ExpertParallelism
    """Routed experts per MoE layer, and the expert (tensor) parallel sizes."""
    ffn_hidden_size: int
    """One expert's MLP width (``--moe-ffn-hidden-size``)."""
    router_topk: int = 2
    """Experts each token is routed to (``--moe-router-topk``)."""
    layer_freq: int | tuple[int, ...] = 1
    """Megatron's ``--moe-layer-freq``: every ``N``-th layer from layer 0 is an MoE layer, or one
    0/1 flag per layer."""

    def __post_init__(self) -> None:
        experts = self.experts
        for name, value in (("num_experts", experts.num_experts), ("ffn_hidden_size", self.ffn_hidden_size),
                            ("router_topk", self.router_topk),
                            ("expert_model_parallel_size", experts.expert_parallel_size),
                            ("expert_tensor_parallel_size", experts.expert_tensor_parallel_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.router_topk > experts.num_experts:
            raise ValueError(f"router top-k {self.router_topk} exceeds the {experts.num_experts} experts")
        if experts.num_experts % experts.expert_parallel_size:
            raise ValueError(f"{experts.num_experts} experts cannot be split evenly over "
                             f"{experts.expert_parallel_size} expert-parallel ranks")
        freq = self.layer_freq
        if (freq < 1) if isinstance(freq, int) else bool(set(freq) - {0, 1}):
            raise ValueError(f"layer_freq must be a positive integer or 0/1 flags, got {freq!r}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) is an MoE layer."""
        if isinstance(self.layer_freq, int):
            return layer % self.layer_freq == 0
        return bool(self.layer_freq[layer])


@dataclass(frozen=True)
class SyntheticModel:
    """Dimensions of a GPT model with a SwiGLU MLP, for :func:`synthetic_profile`. The defaults are
    a 7B-class (LLaMA-2-7B-like) model."""

    num_layers: int = 32
    """Transformer layers."""
    hidden_size: int = 4096
    """Model width."""
    ffn_hidden_size: int = 11008
    """MLP width (SwiGLU: three weight matrices)."""
    vocab_size: int = 32000
    """Vocabulary size (untied input and output embeddings)."""
    seq_length: int = 4096
    """Tokens per sample."""
    micro_batch_size: int = 1
    """Samples per micro-batch."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size the costs are given for (with sequence parallelism)."""
    moe: SyntheticMoE | None = None
    """The mixture-of-experts layers; ``None`` for a dense model."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "vocab_size", "seq_length",
                     "micro_batch_size", "tensor_model_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.moe is not None and not isinstance(self.moe.layer_freq, int) \
                and len(self.moe.layer_freq) != self.num_layers:
            raise ValueError(f"the MoE layer pattern names {len(self.moe.layer_freq)} layers, "
                             f"the model has {self.num_layers}")


@dataclass(frozen=True)
class SyntheticDevice:
    """An accelerator for :func:`synthetic_profile`. The defaults describe a device of the class the
    ElasWave paper used (about 300 dense bf16 TFLOP/s, 64 GiB) on a 200 Gb/s fabric."""

    name: str = "synthetic 300-TFLOP/s accelerator"
    """Device name written into the profile."""
    peak_tflops: float = 300.0
    """Dense bf16 peak, TFLOP/s."""
    model_flops_utilisation: float = 0.45
    """Fraction of peak a transformer layer reaches."""
    memory_bytes: int = 64 * 2**30
    """Usable device memory."""
    bandwidth_bytes_per_s: float = 25e9
    """Per-device network bandwidth (data-parallel collectives, pipeline sends, migration)."""
    p2p_latency_s: float = 20e-6
    """Latency of one pipeline send."""
    compute_bound_fraction: float = 0.85
    """Share of layer time that scales with the clock."""

    def __post_init__(self) -> None:
        if self.peak_tflops <= 0 or not 0 < self.model_flops_utilisation <= 1:
            raise ValueError("peak_tflops must be positive and model_flops_utilisation in (0, 1]")
        if self.memory_bytes <= 0 or self.bandwidth_bytes_per_s <= 0 or self.p2p_latency_s < 0:
            raise ValueError("memory_bytes and bandwidth_bytes_per_s must be positive, p2p_latency_s >= 0")
        if not 0 <= self.compute_bound_fraction <= 1:
            raise ValueError("compute_bound_fraction must be in [0, 1]")


def synthetic_profile(
    model: SyntheticModel = SyntheticModel(), device: SyntheticDevice = SyntheticDevice()
) -> Profile:
    """A profile computed from FLOP counts instead of measured.

    Per layer and micro-batch of ``b`` samples of ``s`` tokens, width ``h``, MLP width ``f``, TP
    size ``t``: forward FLOPs ``2bs(4h^2 + 3hf) + 4bs^2h``, all divided by ``t``; backward twice the
    forward; activations ``34 bsh / t`` bytes (bf16, sequence parallelism, flash attention: the
    Korthikanti et al. count without the attention-score term). The output layer costs
    ``2bshV / t`` FLOPs forward and keeps fp32 logits. An MoE layer is costed by
    :func:`_moe_layer`.
    """
    b, s, h, f, v, t = (
        model.micro_batch_size,
        model.seq_length,
        model.hidden_size,
        model.ffn_hidden_size,
        model.vocab_size,
        model.tensor_model_parallel_size,
    )
    flops_per_s = device.peak_tflops * 1e12 * device.model_flops_utilisation
    layer_forward_flops = (2 * b * s * (4 * h * h + 3 * h * f) + 4 * b * s * s * h) / t
    dense = OpCost(
        forward_s=layer_forward_flops / flops_per_s,
        backward_s=2 * layer_forward_flops / flops_per_s,
        param_bytes=2 * (4 * h * h + 3 * h * f) // t + 2 * 2 * h,
        activation_bytes=34 * b * s * h // t,
    )
    moe = None if model.moe is None else _moe_layer(model, flops_per_s)
    layers = tuple(moe if moe is not None and model.moe.is_moe_layer(i) else dense
                   for i in range(model.num_layers))
    # The embedding lookup is memory bound: charge one pass over its output at 1 TB/s.
    embedding_output_bytes = 2 * b * s * h // t
    embedding = OpCost(
        forward_s=embedding_output_bytes / 1e12,
        backward_s=2 * embedding_output_bytes / 1e12,
        param_bytes=2 * v * h // t,
        activation_bytes=embedding_output_bytes,
    )
    output_forward_flops = 2 * b * s * h * v / t
    loss = OpCost(
        forward_s=output_forward_flops / flops_per_s,
        backward_s=2 * output_forward_flops / flops_per_s,
        param_bytes=2 * v * h // t + 2 * h,
        activation_bytes=4 * b * s * v // t + 2 * b * s * h // t,
    )
    return Profile(
        device=device.name,
        config=_synthetic_config(model, device),
        layers=layers,
        embedding=embedding,
        loss=loss,
        p2p_latency_s=device.p2p_latency_s,
        dp_bandwidth_bytes_per_s=device.bandwidth_bytes_per_s,
        p2p_bandwidth_bytes_per_s=device.bandwidth_bytes_per_s,
        device_memory_bytes=device.memory_bytes,
        compute_bound_fraction=device.compute_bound_fraction,
    )


def _moe_layer(model: SyntheticModel, flops_per_s: float) -> OpCost:
    """An MoE layer of ``model``: attention as in a dense layer, then a router over ``E``
    experts and, for each of a token's top ``k`` experts, a SwiGLU MLP of width ``f_e``.

    With balanced routing a rank computes, whatever the expert-parallel size, ``k`` expert MLPs
    for each of its ``bs/t`` tokens (the dispatch spreads them over the expert-parallel ranks,
    and each gets as many back): forward FLOPs ``(2bs(4h^2 + hE + 3khf_e) + 4bs^2h) / t``,
    backward twice that; the all-to-alls are not included. Parameters: the attention's
    ``2 * 4h^2 / t`` bytes, the router's ``2hE``, two norms, and ``E / EP`` experts of
    ``2 * 3hf_e / ETP`` bytes each. Activations: the attention's share of the dense count,
    ``15 bsh / t``, plus the dense MLP's ``19 bsh / t`` scaled by ``k f_e / f``. Each all-to-all
    of one micro-batch sends ``k bsh / t`` bf16 elements."""
    moe, experts = model.moe, model.moe.experts
    b, s, h, f, t = (model.micro_batch_size, model.seq_length, model.hidden_size,
                     model.ffn_hidden_size, model.tensor_model_parallel_size)
    e, k, f_e = experts.num_experts, moe.router_topk, moe.ffn_hidden_size
    forward_flops = (2 * b * s * (4 * h * h + h * e + 3 * k * h * f_e) + 4 * b * s * s * h) / t
    expert_param_bytes = (e // experts.expert_parallel_size) * (2 * 3 * h * f_e
                                                               // experts.expert_tensor_parallel_size)
    return OpCost(
        forward_s=forward_flops / flops_per_s,
        backward_s=2 * forward_flops / flops_per_s,
        param_bytes=2 * 4 * h * h // t + 2 * h * e + 2 * 2 * h + expert_param_bytes,
        activation_bytes=(15 * b * s * h + 19 * b * s * h * k * f_e // f) // t,
        moe=ExpertCost(expert_param_bytes=expert_param_bytes,
                       all_to_all_bytes=2 * k * b * s * h // t),
    )


def _synthetic_config(model: SyntheticModel, device: SyntheticDevice) -> ProfileConfig:
    """The configuration a synthetic profile is given for, with its dimensions as notes."""
    notes = {
        "synthetic": True,
        "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_hidden_size,
        "vocab_size": model.vocab_size,
        "num_layers": model.num_layers,
        "peak_tflops": device.peak_tflops,
        "model_flops_utilisation": device.model_flops_utilisation,
    }
    experts = {}
    if model.moe is not None:
        notes.update(moe_ffn_hidden_size=model.moe.ffn_hidden_size,
                     moe_router_topk=model.moe.router_topk)
        experts = dict(num_experts=model.moe.experts.num_experts,
                       expert_model_parallel_size=model.moe.experts.expert_parallel_size,
                       expert_tensor_parallel_size=model.moe.experts.expert_tensor_parallel_size)
    return ProfileConfig(
        tensor_model_parallel_size=model.tensor_model_parallel_size,
        micro_batch_size=model.micro_batch_size,
        seq_length=model.seq_length,
        params_dtype_bytes=2,
        **experts,
        notes=notes,
    )
