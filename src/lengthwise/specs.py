"""What is trained (ModelSpec), on what (ClusterSpec), and how it is split (ParallelScheme).

Plain keyword-only dataclasses; every field says its unit. Validation lives in `validate()` of
each class and raises `UserError` showing the arithmetic, e.g.
`dp(2) * tp(2) * pp(4) * cp(1) = 16 != gpus(32)`.

Model presets carry the real config numbers of the models the papers train (Hugging Face
`config.json` for Qwen2.5 and LLaMA-2; SlimPack table 3 for LLaMA 70B/150B; Hydraulis' 32B is
taken as the LLaMA-1 33B shape, which its paper does not spell out).
"""

from __future__ import annotations

import dataclasses
import re
import json
from dataclasses import dataclass
from pathlib import Path

from lengthwise.errors import UserError


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A Llama/Qwen2-family decoder-only transformer."""

    name: str = "custom"
    """Label used in reports."""
    num_layers: int
    """Decoder layers."""
    hidden: int
    """Model width d (elements)."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when < num_heads)."""
    head_dim: int
    """Elements per attention head."""
    ffn: int
    """SwiGLU intermediate width (elements)."""
    vocab: int
    """Vocabulary size (tokens)."""
    tied_embeddings: bool = False
    """Input embedding and output projection share one matrix."""
    qkv_bias: bool = False
    """Q, K and V projections have a bias (Qwen2)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rms_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_scaling: tuple[float, float, float, int] | None = None
    """Llama-3 frequency scaling (`rope_type: llama3`): (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings); None for plain rotary."""

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        """Parameters of one decoder layer: attention, SwiGLU MLP and two RMSNorms."""
        attn = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return attn + bias + 3 * self.hidden * self.ffn + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        """Input embedding plus output head (once if tied) plus the final norm."""
        heads = 1 if self.tied_embeddings else 2
        return heads * self.vocab * self.hidden + self.hidden

    @property
    def num_params(self) -> int:
        return self.num_layers * self.params_per_layer + self.embedding_params

    def validate(self) -> None:
        for field in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "ffn", "vocab"):
            if getattr(self, field) <= 0:
                raise UserError(f"model {self.name}: {field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"model {self.name}: num_heads({self.num_heads}) % num_kv_heads({self.num_kv_heads}) != 0"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelSpec:
        scaling = data.get("rope_scaling")
        return cls(**data | {"rope_scaling": None if scaling is None else tuple(scaling)})

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelSpec:
        """Read a Hugging Face `config.json` (a file, or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"no model config at {path}: give a preset name or a config.json") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return model_from_hf_dict(cfg, name=path.parent.name or path.stem)


_SUPPORTED_ARCHS = {"LlamaForCausalLM": False, "Qwen2ForCausalLM": True}


def model_from_hf_dict(cfg: dict, name: str = "custom") -> ModelSpec:
    """ModelSpec from the fields of a Llama or Qwen2 Hugging Face config dict."""
    arch = (cfg.get("architectures") or [None])[0]
    model_type = cfg.get("model_type")
    if arch not in _SUPPORTED_ARCHS and model_type not in ("llama", "qwen2"):
        raise UserError(
            f"config field architectures={arch!r} (model_type={model_type!r}) is not supported: "
            f"lengthwise runs {', '.join(_SUPPORTED_ARCHS)}"
        )
    for field in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if field not in cfg:
            raise UserError(f"model config lacks the field {field!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"config field hidden_act={cfg['hidden_act']!r} is not supported: lengthwise runs silu")
    _reject_unsupported_fields(cfg)
    heads = cfg["num_attention_heads"]
    is_qwen = model_type == "qwen2" or arch == "Qwen2ForCausalLM"
    spec = ModelSpec(
        name=name,
        num_layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn=cfg["intermediate_size"],
        vocab=cfg["vocab_size"],
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", is_qwen)),
        rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_scaling=_rope_scaling(cfg),
    )
    spec.validate()
    return spec


_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_scaling(cfg: dict) -> tuple[float, float, float, int] | None:
    """Llama-3 scaling from `rope_scaling` (transformers 4) or `rope_parameters` (5)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise UserError(f"config field rope_scaling / rope_parameters with rope_type={rope_type!r} is not "
                        f"supported: use 'default' or 'llama3'")
    missing = [f for f in _LLAMA3_FIELDS if f not in rope]
    if missing:
        raise UserError(f"config's llama3 rope scaling lacks {', '.join(missing)}")
    return (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]))


def _reject_unsupported_fields(cfg: dict) -> None:
    """Fields that would change the maths of the executor's model."""
    if cfg.get("mlp_bias"):
        raise UserError("config field mlp_bias=true is not supported: lengthwise's MLP has no bias")
    if cfg.get("attention_bias") and cfg.get("model_type") == "llama":
        raise UserError("config field attention_bias=true is not supported for llama (it adds an o_proj bias)")
    if cfg.get("use_sliding_window"):
        raise UserError("config field use_sliding_window=true is not supported: lengthwise attends to the whole context")
    if cfg.get("attention_dropout", 0.0):
        raise UserError(f"config field attention_dropout={cfg['attention_dropout']} is not supported: set it to 0.0")


def _qwen(name, layers, hidden, heads, kv, ffn, vocab, tied):
    return ModelSpec(
        name=name, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kv,
        head_dim=hidden // heads, ffn=ffn, vocab=vocab, tied_embeddings=tied, qkv_bias=True,
        rope_theta=1000000.0,
    )


def _llama(name, layers, hidden, heads, kv, ffn, vocab=32000):
    return ModelSpec(
        name=name, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kv,
        head_dim=hidden // heads, ffn=ffn, vocab=vocab, rms_eps=1e-5,
    )


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _qwen("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, True),
        _qwen("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, True),
        _qwen("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, False),
        _qwen("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, False),
        _qwen("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, False),
        _qwen("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, False),
        _llama("llama2-7b", 32, 4096, 32, 32, 11008),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824),
        # Hydraulis' 32B (hydraulis.txt line 281, "LLaMA2 series ... 32B"; no dims in its text): LLaMA's
        # 33B width, depth and FFN with 64 heads of 104, so that its Megatron-LM schemes' TP 16 and
        # TP 8 x PP 2 (Table 3, line 611) divide heads and layers; LLaMA's own 52 heads refuse both
        _llama("llama-32b", 60, 6656, 64, 64, 17920),
        # SlimPack's Table 3 (slimpack.txt lines 184-188): 7B, 13B, 70B (64 heads, 8 groups) and 150B
        # (96 heads, 8 groups) as below; InfiniPipe's GPT 7B/13B (infinipipe.txt line 345) give no dims
        # and run as LLaMA2's
        _llama("llama-70b", 80, 8192, 64, 8, 28672),
        _llama("llama-150b", 96, 12288, 96, 8, 32768),
        # Small enough to train on a CPU in a minute; byte-level vocabulary.
        _llama("tiny", 4, 128, 4, 2, 344, vocab=260),
        # The same size as a Qwen2: q/k/v biases and tied embeddings.
        _qwen("tiny-qwen", 4, 128, 4, 2, 344, 260, True),
    )
}


def model_preset(name_or_path: str) -> ModelSpec:
    """A preset by name, or a Hugging Face config.json path."""
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]
    if name_or_path.endswith(".json") or Path(name_or_path).is_dir():
        return ModelSpec.from_hf_config(name_or_path)
    raise UserError(
        f"unknown model {name_or_path!r}: use a config.json path or one of {', '.join(MODEL_PRESETS)}"
    )


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Homogeneous GPUs in nodes; links described by alpha-beta parameters."""

    name: str = "custom"
    """Label used in reports."""
    num_gpus: int
    """GPUs in the cluster."""
    gpus_per_node: int = 8
    """GPUs sharing the fast intra-node links."""
    gpu_memory_gb: float = 80.0
    """Usable memory per GPU in GiB (2**30 bytes)."""
    peak_tflops: float = 989.0
    """Dense bf16 peak per GPU in TFLOP/s (10**12 FLOP per second)."""
    intra_bw_gbps: float = 900.0
    """Intra-node bandwidth per GPU in GB/s (10**9 bytes per second, unidirectional)."""
    inter_bw_gbps: float = 50.0
    """Inter-node bandwidth per GPU in GB/s (400 Gb/s InfiniBand = 50 GB/s)."""
    intra_latency_us: float = 10.0
    """Start-up latency (alpha) of an intra-node transfer, microseconds."""
    inter_latency_us: float = 20.0
    """Start-up latency (alpha) of an inter-node transfer, microseconds."""

    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.gpu_memory_gb * 2**30)

    def validate(self) -> None:
        if self.num_gpus <= 0 or self.gpus_per_node <= 0:
            raise UserError(f"cluster {self.name}: num_gpus and gpus_per_node must be positive")
        if self.gpu_memory_gb <= 0 or self.peak_tflops <= 0:
            raise UserError(f"cluster {self.name}: gpu_memory_gb and peak_tflops must be positive")

    def with_gpus(self, num_gpus: int) -> ClusterSpec:
        return dataclasses.replace(self, num_gpus=num_gpus)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ClusterSpec:
        return cls(**data)


CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    # H100-80G SXM, 8 per node, NVLink 900 GB/s, 400 Gb/s IB per GPU (skrull/infinipipe testbeds).
    "h100": ClusterSpec(name="h100", num_gpus=8, gpu_memory_gb=80.0, peak_tflops=989.0,
                        intra_bw_gbps=900.0, inter_bw_gbps=50.0),
    # A800-80G, 8 per node, NVLink 400 GB/s, 200 Gb/s IB per GPU (hydraulis/chunkflow testbeds).
    "a800": ClusterSpec(name="a800", num_gpus=8, gpu_memory_gb=80.0, peak_tflops=312.0,
                        intra_bw_gbps=400.0, inter_bw_gbps=25.0),
    # One CPU process, for the executor's own runs; the numbers are nominal.
    "cpu": ClusterSpec(name="cpu", num_gpus=1, gpus_per_node=1, gpu_memory_gb=16.0, peak_tflops=0.5,
                       intra_bw_gbps=10.0, inter_bw_gbps=10.0),
}


def cluster_preset(name: str, num_gpus: int | None = None) -> ClusterSpec:
    if name not in CLUSTER_PRESETS:
        raise UserError(f"unknown cluster {name!r}: use one of {', '.join(CLUSTER_PRESETS)}")
    cluster = CLUSTER_PRESETS[name]
    return cluster.with_gpus(num_gpus) if num_gpus else cluster


@dataclass(frozen=True, kw_only=True)
class ParallelScheme:
    """Degrees of parallelism; GPUs used = dp * tp * pp * cp."""

    dp: int = 1
    """Data-parallel replicas (pipelines)."""
    tp: int = 1
    """Tensor-parallel degree inside a stage."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel degree: ranks that share one sharded sequence."""
    zero: int = 1
    """ZeRO stage over the data-parallel group: 0 none, 1 optimizer, 2 +gradients, 3 +parameters."""

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def gpus_per_pipeline(self) -> int:
        return self.tp * self.pp * self.cp

    def __str__(self) -> str:
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}-cp{self.cp}"

    @classmethod
    def parse(cls, text: str, *, zero: int = 1) -> ParallelScheme:
        """The string form back: 'dp8-tp4-pp1-cp1' (any order; a missing degree is 1)."""
        degrees = {}
        for part in text.strip().split("-"):
            m = re.fullmatch(r"(dp|tp|pp|cp)(\d+)", part)
            if m is None or m.group(1) in degrees:
                raise UserError(f"bad scheme {text!r}: write it as dpD-tpT-ppP-cpC, e.g. dp8-tp4-pp1-cp1")
            degrees[m.group(1)] = int(m.group(2))
        return cls(**degrees, zero=zero)

    def validate(self, model: ModelSpec | None = None, num_gpus: int | None = None) -> None:
        for field in ("dp", "tp", "pp", "cp"):
            if getattr(self, field) < 1:
                raise UserError(f"--{field} must be at least 1, got {getattr(self, field)}")
        if self.zero not in (0, 1, 2, 3):
            raise UserError(f"zero stage must be 0, 1, 2 or 3, got {self.zero}")
        if num_gpus is not None and self.num_gpus != num_gpus:
            raise UserError(
                f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) * cp({self.cp}) = {self.num_gpus}"
                f" != gpus({num_gpus})"
            )
        if model is not None and model.num_layers % self.pp:
            raise UserError(f"pp({self.pp}) does not divide the layers: {model.name} has {model.num_layers}")
        if model is not None and model.num_heads % self.tp:
            raise UserError(f"tp({self.tp}) does not divide the heads: {model.name} has {model.num_heads}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ParallelScheme:
        return cls(**data)
