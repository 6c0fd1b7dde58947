"""Tensor parallelism of one stage's model with DTensor (Megatron's split, torchtitan's plan).

Per decoder layer: q/k/v and the SwiGLU gate/up projections column-parallel (each TP rank
computes its heads / its slice of the intermediate width), o_proj and down_proj row-parallel
(partial sums all-reduced), norms replicated. The embedding is split by vocabulary rows
(row-parallel, lookups of rows another rank holds give 0, summed over TP), the LM head by
vocabulary columns, its logits left sharded for the vocabulary-parallel cross-entropy
(`loss_parallel`, entered by the executor around forward and backward).

Activations between layers and between stages stay whole on every TP rank, so the pipeline
transport, the K/V state store and CP's gathers work on each TP rank's own heads unchanged:
the K/V state of a split sequence is kept per TP shard.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lengthwise.errors import UserError
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
    if spec.num_kv_heads % tp:
        raise UserError(f"tp={tp} does not divide the model's {spec.num_kv_heads} key/value heads: "
                        f"use a tp that divides {spec.num_kv_heads}")
    if spec.vocab % tp:
        raise UserError(f"tp={tp} does not divide the vocabulary of {spec.vocab} tokens: "
                        f"use a tp that divides {spec.vocab}")


def apply_tp(model: CausalLM, mesh: DeviceMesh) -> CausalLM:
    """Parallelise `model` (one stage, on the meta device or materialised) over the 1-D TP
    mesh, in place."""
    check_tp(model.spec, mesh.size())
    for layer in model.model.layers.values():
        parallelize_module(layer, mesh, LAYER_PLAN)
    if hasattr(model.model, "embed_tokens"):
        parallelize_module(model.model.embed_tokens, mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if model.part.last:
        parallelize_module(model.lm_head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    model.tie()  # both now hold vocabulary rows Shard(0): the head reuses the embedding's DTensor
    return model
