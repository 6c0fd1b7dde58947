"""Checkpoints in Hugging Face's format: `config.json` + `model.safetensors` with HF names.

    save_pretrained(model, "ckpt/")            # ckpt/config.json, ckpt/model.safetensors
    load_weights(model, "ckpt/")               # or a .safetensors file, or a sharded index

A directory written here loads with `transformers.AutoModelForCausalLM.from_pretrained`, and
a Hugging Face Llama/Qwen2 checkpoint loads here, unchanged: the parameter names are the
same (`model.layers.0.self_attn.q_proj.weight`, ...). With tied embeddings the file holds no
`lm_head.weight`, as Hugging Face writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lengthwise.errors import UserError
from lengthwise.plan.ir import write_atomic
from lengthwise.runtime.model import CausalLM
from lengthwise.specs import ModelSpec

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
    if not qwen:
        cfg |= {"attention_bias": False, "mlp_bias": False}
    return cfg


def expected_names(model: CausalLM) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes of the model, in Hugging Face's spelling."""
    names = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if model.spec.tied_embeddings:
        del names["lm_head.weight"]
    return names


def save_pretrained(model: CausalLM, directory: str | Path) -> None:
    """Write config.json and model.safetensors (atomically, each)."""
    from safetensors.torch import save

    directory = Path(directory)
    state = model.state_dict()
    tensors = {name: state[name].detach().contiguous().cpu() for name in expected_names(model)}
    write_atomic(directory / WEIGHTS_NAME, save(tensors, metadata={"format": "pt"}))
    write_atomic(directory / "config.json", json.dumps(hf_config_dict(model.spec), indent=1))


def load_weights(model: CausalLM, path: str | Path) -> None:
    """Load a .safetensors file, a directory holding one, or a sharded index, into the model."""
    load_state(model, read_tensors(path))


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / INDEX_NAME if (path / INDEX_NAME).exists() else path / WEIGHTS_NAME
    if not path.exists():
        raise UserError(f"no weights at {path}: give a .safetensors file or a directory holding {WEIGHTS_NAME}")
    if path.name.endswith(".index.json"):
        shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        return {name: t for shard in shards for name, t in load_file(path.parent / shard).items()}
    return load_file(path)


@torch.no_grad()
def load_state(model: CausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Copy tensors into the model; UserError naming the first missing, unexpected or
    mis-shaped tensor."""
    expected = expected_names(model)
    _check_names(expected, tensors, tied=model.spec.tied_embeddings)
    params = model.state_dict()
    for name in expected:
        params[name].copy_(tensors[name])


def _check_names(expected: dict[str, tuple[int, ...]], tensors: dict[str, torch.Tensor], *, tied: bool) -> None:
    for name, shape in expected.items():
        if name not in tensors:
            raise UserError(f"checkpoint lacks {name} (shape {list(shape)}): is it for this model config?")
        if tuple(tensors[name].shape) != shape:
            raise UserError(f"checkpoint tensor {name} has shape {list(tensors[name].shape)}, the model "
                            f"config needs {list(shape)}")
    for name in tensors:
        if name in expected:
            continue
        if tied and name == "lm_head.weight" and torch.equal(tensors[name], tensors["model.embed_tokens.weight"]):
            continue  # some writers keep the tied copy
        raise UserError(f"checkpoint has unexpected tensor {name}: the model config "
                        f"{'ties the embeddings' if name == 'lm_head.weight' else 'has no such parameter'}")
