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
        ...                                       # any other keys are kept as notes
      },
      "layers": [                                 # one entry per transformer layer, in order
        {"forward_s": 0.011, "backward_s": 0.022,
         "param_bytes": 50331648, "activation_bytes": 268435456},
        ...
      ],
      "embedding": {...same four keys...},        # word (+ position) embedding, first stage
      "loss": {...same four keys...},             # final norm, output layer and loss, last stage
      "p2p_latency_s": 2e-05,                     # one pipeline send, zero bytes
      "p2p_bandwidth_bytes_per_s": 2.5e10,        # optional, default dp_bandwidth_bytes_per_s
      "dp_bandwidth_bytes_per_s": 2.5e10,         # per-rank bandwidth of data-parallel collectives
      "device_memory_bytes": 68719476736,         # optional, null: no memory cap
      "compute_bound_fraction": 0.85,             # optional, default 0.85: share of layer time
                                                  #   that scales with the clock (DVFS model)
      "pipeline_message_bytes": 16777216          # optional, default embedding.activation_bytes:
    }                                             #   bytes of one pipeline send (hidden states)

``activation_bytes`` is what one micro-batch leaves in memory for the backward pass of that layer.
When a job runs at another tensor-parallel size or micro-batch size than the profile was measured
at, :mod:`megatron_elaswave.planner.cost` scales times and activations linearly in
``micro_batch_size / tensor_model_parallel_size`` and parameter bytes in
``1 / tensor_model_parallel_size``; the job's sequence length is the profile's. ``version`` must be
1; unknown top-level keys are ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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

    def __post_init__(self) -> None:
        _number(self.forward_s, "forward_s")
        _number(self.backward_s, "backward_s")
        _integer(self.param_bytes, "param_bytes")
        _integer(self.activation_bytes, "activation_bytes")

    @classmethod
    def from_json(cls, record: Any, where: str) -> "OpCost":
        if not isinstance(record, dict):
            raise ProfileError(f"{where} must be an object, got {type(record).__name__}")
        missing = [
            k for k in ("forward_s", "backward_s", "param_bytes", "activation_bytes") if k not in record
        ]
        if missing:
            raise ProfileError(f"{where} is missing {', '.join(missing)}")
        return cls(
            forward_s=_number(record["forward_s"], f"{where}.forward_s"),
            backward_s=_number(record["backward_s"], f"{where}.backward_s"),
            param_bytes=_integer(record["param_bytes"], f"{where}.param_bytes"),
            activation_bytes=_integer(record["activation_bytes"], f"{where}.activation_bytes"),
        )


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
    notes: dict = field(default_factory=dict)
    """Any other keys of the ``config`` object, kept for the record."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "micro_batch_size", "seq_length", "params_dtype_bytes"):
            _integer(getattr(self, name), f"config.{name}", minimum=1)

    @classmethod
    def from_json(cls, record: Any) -> "ProfileConfig":
        if not isinstance(record, dict):
            raise ProfileError("config must be an object")
        required = ("tensor_model_parallel_size", "micro_batch_size", "seq_length")
        missing = [k for k in required if k not in record]
        if missing:
            raise ProfileError(f"config is missing {', '.join(missing)}")
        known = required + ("params_dtype_bytes",)
        return cls(
            **{k: _integer(record[k], f"config.{k}", minimum=1) for k in known if k in record},
            notes={k: v for k, v in record.items() if k not in known},
        )

    def to_json(self) -> dict:
        record = {k: v for k, v in asdict(self).items() if k != "notes"}
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
        fraction = _number(self.compute_bound_fraction, "compute_bound_fraction")
        if fraction > 1:
            raise ProfileError(f"compute_bound_fraction must be in [0, 1], got {fraction}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def p2p_bandwidth(self) -> float:
        return self.p2p_bandwidth_bytes_per_s or self.dp_bandwidth_bytes_per_s

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
            "layers": [asdict(layer) for layer in self.layers],
            "embedding": asdict(self.embedding),
            "loss": asdict(self.loss),
            "p2p_latency_s": self.p2p_latency_s,
            "p2p_bandwidth_bytes_per_s": self.p2p_bandwidth_bytes_per_s,
            "dp_bandwidth_bytes_per_s": self.dp_bandwidth_bytes_per_s,
            "device_memory_bytes": self.device_memory_bytes,
            "compute_bound_fraction": self.compute_bound_fraction,
            "pipeline_message_bytes": self.pipeline_message_bytes,
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

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


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
    ``2bshV / t`` FLOPs forward and keeps fp32 logits.
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
    layer = OpCost(
        forward_s=layer_forward_flops / flops_per_s,
        backward_s=2 * layer_forward_flops / flops_per_s,
        param_bytes=2 * (4 * h * h + 3 * h * f) // t + 2 * 2 * h,
        activation_bytes=34 * b * s * h // t,
    )
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
        config=ProfileConfig(
            tensor_model_parallel_size=t,
            micro_batch_size=b,
            seq_length=s,
            params_dtype_bytes=2,
            notes={
                "synthetic": True,
                "hidden_size": h,
                "ffn_hidden_size": f,
                "vocab_size": v,
                "num_layers": model.num_layers,
                "peak_tflops": device.peak_tflops,
                "model_flops_utilisation": device.model_flops_utilisation,
            },
        ),
        layers=(layer,) * model.num_layers,
        embedding=embedding,
        loss=loss,
        p2p_latency_s=device.p2p_latency_s,
        dp_bandwidth_bytes_per_s=device.bandwidth_bytes_per_s,
        p2p_bandwidth_bytes_per_s=device.bandwidth_bytes_per_s,
        device_memory_bytes=device.memory_bytes,
        compute_bound_fraction=device.compute_bound_fraction,
    )
