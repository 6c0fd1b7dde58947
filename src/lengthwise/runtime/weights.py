"""Checkpoints in Hugging Face's format: `config.json` + `model.safetensors` with HF names.

    save_pretrained(model, "ckpt/")            # ckpt/config.json, ckpt/model.safetensors
    load_weights(model, "ckpt/")               # or a .safetensors file, or a sharded index

A directory written here loads with `transformers.AutoModelForCausalLM.from_pretrained`, and
a Hugging Face Llama/Qwen2 checkpoint loads here, unchanged: the parameter names are the
same (`model.layers.0.self_attn.q_proj.weight`, ...). With tied embeddings the file holds no
`lm_head.weight`, as Hugging Face writes it.

A stage's model (`model.StagePart`) reads only its own tensors: `safetensors.safe_open` maps
the file and copies just the keys the stage holds (from the shards the index names for them),
so loading a 70B checkpoint on a pipeline stage costs that stage's memory, not the model's.
Shapes are checked from the file's header before any tensor is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from lengthwise.errors import UserError
from lengthwise.files import write_atomic
from lengthwise.runtime.finite import first_nonfinite_tensor
from lengthwise.runtime.model import CausalLM, parameter_names
from lengthwise.specs import ModelSpec
from lengthwise.unreadable import refuse_unreadable

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def hf_config_dict(spec: ModelSpec) -> dict:
    """The Hugging Face config of `spec`: Qwen2 when q/k/v carry a bias, else Llama."""
    qwen = spec.qkv_bias
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "intermediate_size": spec.ffn, "vocab_size": spec.vocab,
        "tie_word_embeddings": spec.tied_embeddings, "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_eps, "hidden_act": "silu", "attention_dropout": 0.0,
        "max_position_embeddings": 1 << 20,
    }
    if spec.rope_scaling is not None:
        factor, low, high, context = spec.rope_scaling
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                               "high_freq_factor": high, "original_max_position_embeddings": context,
                               "rope_theta": spec.rope_theta}
    if not qwen:
        cfg |= {"attention_bias": False, "mlp_bias": False}
    return cfg


def expected_names(model: CausalLM) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes of the model, in Hugging Face's spelling."""
    names = {name: _unpadded(name, tuple(t.shape), model.spec.vocab) for name, t in model.state_dict().items()}
    if model.spec.tied_embeddings and "lm_head.weight" in names:
        del names["lm_head.weight"]
    return names


VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")
"""Tensors with one row per vocabulary entry (padded under tensor parallelism, Megatron's way)."""


def _unpadded(name: str, shape: tuple[int, ...], vocab: int) -> tuple[int, ...]:
    return (vocab, *shape[1:]) if name in VOCAB_ROWS else shape


def save_pretrained(model: CausalLM, directory: str | Path) -> None:
    """Write config.json and model.safetensors (atomically, each)."""
    state = model.state_dict()
    save_tensors_pretrained({name: state[name] for name in expected_names(model)}, model.spec, directory)


def save_tensors_pretrained(tensors: dict[str, torch.Tensor], spec: ModelSpec, directory: str | Path) -> None:
    """config.json and model.safetensors from whole tensors by their Hugging Face names (a
    state dict gathered from the ranks of a distributed run: no model is built for it). Every
    parameter of `spec` must be there (the tied head is not written); UserError naming the
    first missing one."""
    from safetensors.torch import save

    names = parameter_names(spec)
    for name in names:
        if name not in tensors:
            raise UserError(f"cannot write {directory}: the weights lack {name}")
    write_atomic(Path(directory) / WEIGHTS_NAME,
                 save({name: tensors[name].detach().contiguous().cpu() for name in names}, metadata={"format": "pt"}))
    write_atomic(Path(directory) / "config.json", json.dumps(hf_config_dict(spec), indent=1))


def load_weights(model: CausalLM, path: str | Path) -> None:
    """Load a .safetensors file, a directory holding one, or a sharded index, into the model
    (only the tensors the model, maybe one stage, holds)."""
    sources = tensor_sources(path)
    expected = expected_names(model)
    _check_names(expected, sources, spec_names=set(parameter_names(model.spec)),
                 tied=model.spec.tied_embeddings)
    params = model.state_dict()
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(sources[name].file, []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with refuse_unreadable(file, "safetensors file"), _open(file) as handle:
                for name in names:
                    _copy_into(params[name], handle.get_tensor(name))
    check_finite_weights(path, {name: params[name] for name in expected})


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (file, directory or sharded index), read whole."""
    tensors = {}
    for name, source in tensor_sources(path).items():
        with _open(source.file) as handle:
            tensors[name] = handle.get_tensor(name)
    return tensors


@dataclass(frozen=True)
class TensorSource:
    """Where one checkpoint tensor lies, and its shape (from the file's header)."""

    file: Path
    shape: tuple[int, ...]


def tensor_sources(path: str | Path) -> dict[str, TensorSource]:
    """Name -> (file, shape) of every tensor of a checkpoint, reading headers only."""
    path = Path(path)
    if path.is_dir():
        path = path / INDEX_NAME if (path / INDEX_NAME).exists() else path / WEIGHTS_NAME
    if not path.exists():
        raise UserError(f"no weights at {path}: give a .safetensors file or a directory holding {WEIGHTS_NAME}")
    files = [path]
    if path.name.endswith(".index.json"):
        with refuse_unreadable(path, "safetensors index"):
            files = [path.parent / str(shard) for shard in
                     sorted(set(json.loads(path.read_bytes().decode("utf-8"))["weight_map"].values()))]
    sources = {}
    for file in files:
        if not file.exists():
            raise UserError(f"{path} names the shard {file.name}, which is missing from {file.parent}")
        with refuse_unreadable(file, "safetensors file"), _open(file) as handle:
            for name in handle.keys():
                sources[name] = TensorSource(file, tuple(handle.get_slice(name).get_shape()))
    return sources


def check_finite_weights(path: str | Path, params: dict[str, torch.Tensor]) -> None:
    """UserError when a loaded weight holds a NaN or an infinity: training from it cannot learn,
    and no checkpoint after it could be saved (runtime/finite.py). One fused reduction. Sharded
    (DTensor) weights are left to the distributed run, whose ranks must agree before refusing."""
    if any(isinstance(t, DTensor) for t in params.values()):
        return
    bad = first_nonfinite_tensor(params)
    if bad is not None:
        raise UserError(f"{path}: weight {bad} holds NaN or infinite values; start from finite weights "
                        "(another checkpoint, or a config.json for random ones)")


def _open(file: Path):
    from safetensors import safe_open

    return safe_open(str(file), framework="pt", device="cpu")


def _copy_into(param: torch.Tensor, tensor: torch.Tensor) -> None:
    copy_whole(param, tensor)


@torch.no_grad()
def copy_whole(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Store a whole tensor into a parameter; a DTensor (FSDP2 / TP shard) takes its own piece
    (a replicated DTensor redistributed locally, no communication)."""
    whole = whole.to(device=param.device, dtype=param.dtype)
    if whole.shape[0] < param.shape[0]:  # a vocabulary padded for TP: zero rows, never read
        whole = torch.cat([whole, whole.new_zeros((param.shape[0] - whole.shape[0], *whole.shape[1:]))])
    if isinstance(param, DTensor):
        replicated = distribute_tensor(whole, param.device_mesh, [Replicate()] * param.device_mesh.ndim,
                                       src_data_rank=None)
        param.to_local().copy_(replicated.redistribute(param.device_mesh, param.placements).to_local())
    else:
        param.copy_(whole)


@torch.no_grad()
def load_state(model: CausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Copy tensors into the model; UserError naming the first missing, unexpected or
    mis-shaped tensor."""
    expected = expected_names(model)
    sources = {name: TensorSource(Path("."), tuple(t.shape)) for name, t in tensors.items()}
    _check_names(expected, sources, spec_names=set(parameter_names(model.spec)),
                 tied=model.spec.tied_embeddings)
    if model.spec.tied_embeddings and "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors \
            and not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
        raise UserError("checkpoint has unexpected tensor lm_head.weight: the model config ties the embeddings")
    params = model.state_dict()
    for name in expected:
        _copy_into(params[name], tensors[name])


def _check_names(expected: dict[str, tuple[int, ...]], sources: dict[str, TensorSource], *,
                 spec_names: set[str], tied: bool) -> None:
    """`expected`: what this model (or stage) reads; `spec_names`: what the whole model has
    (a stage ignores the other stages' tensors, but no model has any other)."""
    for name, shape in expected.items():
        if name not in sources:
            raise UserError(f"checkpoint lacks {name} (shape {list(shape)}): is it for this model config?")
        if sources[name].shape != shape:
            raise UserError(f"checkpoint tensor {name} has shape {list(sources[name].shape)}, the model "
                            f"config needs {list(shape)}")
    for name in sources:
        if name in spec_names or (tied and name == "lm_head.weight"):
            continue  # another stage's tensor; some writers keep the tied copy
        raise UserError(f"checkpoint has unexpected tensor {name}: the model config has no such parameter")
