"""Tensor parallelism of one stage's model with DTensor (Megatron's split, torchtitan's plan).

Per decoder layer: q/k/v and the SwiGLU gate/up projections column-parallel (each TP rank
computes its heads / its slice of the intermediate width), o_proj and down_proj row-parallel
(partial sums all-reduced), norms replicated. The embedding is split by vocabulary rows
(row-parallel, lookups of rows another rank holds give 0, summed over TP), the LM head by
vocabulary columns, its logits left sharded (each rank's columns, a plain tensor) for the
vocabulary-parallel cross-entropy (`loss.token_loss_sum` with the `VocabShard` this sets as
`model.vocab_shard`).

A vocabulary that tp does not divide is padded to the next multiple (as Megatron does): the
embedding and the head get zero rows no token reads, and the head's padded logits are set to
-inf before the loss, so the softmax and every gradient are the unpadded model's. Checkpoints
keep the real vocabulary (`weights.py` pads on load; gathers trim, `distributed/step.py`).

Grouped-query attention with fewer K/V heads than TP ranks (tp = 8 on Llama-2-70B's 8 heads
is the edge; Qwen2.5-7B has 4): the K/V projections are replicated, every rank computes all G
K/V heads and keeps the one its query heads read (query heads [r H/tp, (r+1) H/tp) read K/V head
r G / tp), as the cost model assumes. A rank's gradient of the replicated K/V weights covers
only its head, so those gradients are summed over TP (`tp_partial_names`, used by
`distributed/dp.reduction_classes`), and so is the gradient flowing back into their input
(Megatron's "copy to the tensor-parallel region": identity forward, all-reduce backward), as
DTensor does for the column-parallel projections' input.

Activations between layers and between stages stay whole on every TP rank, so the pipeline
transport, the K/V state store and CP's gathers work on each TP rank's own heads unchanged:
the K/V state of a split sequence is kept per TP shard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lengthwise.errors import UserError
from lengthwise.runtime.loss import VocabShard
from lengthwise.runtime.model import CausalLM
from lengthwise.specs import ModelSpec

LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}


def check_tp(spec: ModelSpec, tp: int) -> None:
    """One-line errors for sizes a TP degree cannot split."""
    if spec.num_heads % tp:
        raise UserError(f"tp={tp} does not divide the model's {spec.num_heads} attention heads: "
                        f"use a tp that divides {spec.num_heads}")
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        raise UserError(f"tp={tp} neither divides nor is a multiple of the model's {spec.num_kv_heads} "
                        f"key/value heads: use a tp that divides {spec.num_kv_heads} or a multiple of it")


def kv_replicated(spec: ModelSpec, tp: int) -> bool:
    return tp > spec.num_kv_heads


def tp_partial_names(spec: ModelSpec, tp: int) -> Callable[[str], bool]:
    """Whether a parameter's gradient is a partial sum over TP ranks (replicated K/V weights)."""
    replicated = kv_replicated(spec, tp)
    return lambda name: replicated and name.startswith("model.layers.") and \
        name.split(".")[-2] in ("k_proj", "v_proj")


def apply_tp(model: CausalLM, mesh: DeviceMesh) -> CausalLM:
    """Parallelise `model` (one stage, on the meta device or materialised) over the 1-D TP
    mesh, in place."""
    spec, tp = model.spec, mesh.size()
    check_tp(spec, tp)
    plan = dict(LAYER_PLAN)
    if kv_replicated(spec, tp):
        del plan["self_attn.k_proj"], plan["self_attn.v_proj"]
        head = mesh.get_local_rank() * spec.num_kv_heads // tp
        keep = functools.partial(_keep_columns, start=head * spec.head_dim, stop=(head + 1) * spec.head_dim)
    for layer in model.model.layers.values():
        parallelize_module(layer, mesh, plan)
        if kv_replicated(spec, tp):
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.register_forward_pre_hook(functools.partial(_sum_grad_over, group=mesh.get_group()))
                proj.register_forward_hook(keep)
    padded = -(-spec.vocab // tp) * tp
    if padded != spec.vocab:
        _pad_vocabulary(model, padded)
    if hasattr(model.model, "embed_tokens"):
        parallelize_module(model.model.embed_tokens, mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if model.part.last:
        parallelize_module(model.lm_head, mesh, ColwiseParallel(output_layouts=Shard(-1)))
        start = mesh.get_local_rank() * (padded // tp)
        model.vocab_shard = VocabShard(group=mesh.get_group(), start=start)
        if padded != spec.vocab:
            model.lm_head.register_forward_hook(functools.partial(_mask_padding, real=max(0, spec.vocab - start)))
    model.tie()  # both now hold vocabulary rows Shard(0): the head reuses the embedding's DTensor
    return model


def _pad_vocabulary(model: CausalLM, padded: int) -> None:
    """Embedding and head with `padded` rows (same device and dtype; before materialising)."""
    spec = model.spec
    if hasattr(model.model, "embed_tokens"):
        old = model.model.embed_tokens.weight
        model.model.embed_tokens = nn.Embedding(padded, spec.hidden, device=old.device, dtype=old.dtype)
    if model.part.last:
        old = model.lm_head.weight
        model.lm_head = nn.Linear(spec.hidden, padded, bias=False, device=old.device, dtype=old.dtype)
    model.tie()


def _mask_padding(module, inputs, logits, *, real: int):
    """-inf on this rank's padded vocabulary columns (its columns from `real` on)."""
    mask = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
    mask[real:] = float("-inf")
    return logits + mask


class _SumGradOver(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_grad_over(module, inputs, *, group):
    return (_SumGradOver.apply(inputs[0], group), *inputs[1:])


def _keep_columns(module, inputs, out_TX, *, start: int, stop: int):
    """Forward hook: the rank's K/V head of a replicated projection's output."""
    return out_TX[:, start:stop]
