"""Tensor parallelism of one stage's model with DTensor (Megatron's split, torchtitan's plan).

Per decoder layer: q/k/v and the SwiGLU gate/up projections column-parallel (each TP rank
computes its heads / its slice of the intermediate width), o_proj and down_proj row-parallel
(partial sums all-reduced), norms replicated. The embedding is split by vocabulary rows
(row-parallel, lookups of rows another rank holds give 0, summed over TP), the LM head by
vocabulary columns: each rank computes its columns' logits a block at a time inside the
vocabulary-parallel loss (`loss.head_loss_sum` with the `VocabShard` this sets as
`model.vocab_shard` and `lm_head.vocab_shard`), its input gathered whole first
(`_whole_head_input`).

A vocabulary that tp does not divide is padded to the next multiple (as Megatron does): the
embedding and the head get zero rows no token reads, and the head's padded logits are set to
-inf in the loss (`VocabShard.real`), so the softmax and every gradient are the unpadded model's.
Checkpoints keep the real vocabulary (`weights.py` pads on load; gathers trim, `parallel/step.py`).

Grouped-query attention with fewer K/V heads than TP ranks (tp = 8 on Llama-2-70B's 8 heads
is the edge; Qwen2.5-1.5B's 2 are replicated at tp 4): the K/V projections are replicated, every rank computes all G
K/V heads and keeps the one its query heads read (query heads [r H/tp, (r+1) H/tp) read K/V head
r G / tp), as the cost model assumes. A rank's gradient of the replicated K/V weights covers
only its head, so those gradients are summed over TP (`tp_partial_names`, used by
`parallel/dp.reduction_classes`), and so is the gradient flowing back into their input
(Megatron's "copy to the tensor-parallel region": identity forward, all-reduce backward), as
DTensor does for the column-parallel projections' input; under sequence parallelism that sum is
the reduce-scatter of the gathered input's gradient (`_local_with_partial_grad`).

Sequence parallelism (Megatron-LM's, the default; `apply_tp(..., sequence_parallel=False)`
turns it off). The residual stream between the blocks is split by rows (tokens) over TP: a
rank holds rows [r T/tp, (r+1) T/tp) of the chunk, runs the RMSNorms on them
(`SequenceParallel`, norm weights replicated DTensors whose gradients come back partial and
are summed over TP: by FSDP2, or by `parallel/dp.match_grad_layouts`), and each block
all-gathers its normed input before the column-parallel projections (`PrepareModuleInput`,
kept a DTensor so that the projections' partial input gradients are summed once, by the
reduce-scatter that is the all-gather's backward) and reduce-scatters its row-parallel output
(`RowwiseParallel(output_layouts=Shard(0))`) back to the rank's rows instead of all-reducing
it. The embedding reduce-scatters its vocabulary-partial lookups the same way; the LM head
all-gathers the final norm's rows and leaves its logits split by vocabulary. The model never
sees a batch dimension, so the sequence dimension is 0. Per layer and direction: two
all-gathers and two reduce-scatters of T x hidden values (`cost/model.tp_comm_time`), and the
pipeline sends each TP rank's rows only (`cost/model.boundary_bytes`).

Memory: a rank keeps its rows of the residual stream and of the norms' inputs, but the
projections keep the gathered normed input (whole, T x hidden) for their weight gradients, as
DTensor's column-parallel linear does (Megatron gathers it again in backward instead);
`cost/memory.py` counts it whole, as kept here.

Attention needs the whole row: the gathered normed input is cut back to the row's T tokens
(the rotary tables' length) before q/k/v, so rotary positions, the `ChunkLayout` of packed
documents, the K/V context of split sequences and the K/V state store see exactly the tokens
they see without sequence parallelism (each TP rank its own heads, as before).

Rows not divisible by tp: the chunk is padded at its end to the next multiple of tp with
masked tokens, which contribute nothing. The embedding is looked up at a token id no TP rank
holds (the padded vocabulary's size), so a padding row is exactly zero; it stays zero through
every layer (attention drops it before q/k/v and pads its output with zeros, RMSNorm and the
bias-free MLP map 0 to 0), and its label is IGNORE (`stage.py`), so neither the loss nor any
gradient changes. The cost is at most tp - 1 rows of norm, MLP and head work per chunk, and a
zero-padded copy of the attention output when T is not a multiple of tp. (Falling back to no
sequence parallelism for such chunks would change the activations' layout between chunks and
stages; refusing them would refuse most packed rows.) `model.sequence_shards` tells the
executor how many row shards the residual stream has (`stage.py` sizes the messages by it).

Without sequence parallelism, activations between layers and between stages stay whole on
every TP rank (the blocks' outputs are all-reduced, and each block's input gradient once: the
block's input is one Replicate DTensor its column-parallel projections share). In both modes the pipeline transport,
the K/V state store and CP's gathers work on each TP rank's own heads unchanged: the K/V state
of a split sequence is kept per TP shard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lengthwise.errors import UserError
from lengthwise.runtime.loss import VocabShard
from lengthwise.runtime.model import CausalLM, LMHead
from lengthwise.specs import ModelSpec

class SwiGLUDownParallel(RowwiseParallel):
    """The SwiGLU's down projection (`model.DownProjection`), row-parallel as RowwiseParallel
    splits it (the weight's input columns, Shard(1)), but run on local tensors: its inputs,
    this rank's columns of gate and up (or of their product), stay the plain tensors the
    column-parallel gate and up projections return (RowwiseParallel's input hook would make a
    DTensor of the first and drop the second), the module multiplies them by its weight's local
    shard (`layer_ops.SwiGLUDown`, which keeps gate and up but not their product), and its
    output, this rank's partial sum, is reduced to `output_layouts` as RowwiseParallel's is (an
    all-reduce, or the reduce-scatter to this rank's rows)."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        return None

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        partial_TD = DTensor.from_local(outputs, device_mesh, (Partial(),), run_check=False)
        return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, partial_TD, device_mesh)


LAYER_PLAN = {
    # self_attn(x, rope, layout, context, backend): x, whole on every rank, made a Replicate
    # DTensor that the three projections share, so that their partial input gradients are
    # summed first and all-reduced once (Megatron's "copy to the tensor-parallel region")
    "self_attn": PrepareModuleInput(input_layouts=(Replicate(), None, None, None, None),
                                    desired_input_layouts=(Replicate(), None, None, None, None)),
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": SwiGLUDownParallel(),
}
"""Per decoder layer without sequence parallelism: blocks take and return whole activations;
per layer two all-reduces in forward (the row-parallel outputs) and two in backward (each
block's input gradient)."""

ROWS = Shard(0)
"""The residual stream's rows (tokens) split over TP: sequence parallelism's layout."""

SP_LAYER_PLAN = {
    "input_layernorm": SequenceParallel(sequence_dim=0),
    # self_attn(x, rope, layout, context, backend): gather x's rows, leave the rest alone
    "self_attn": PrepareModuleInput(input_layouts=(ROWS, None, None, None, None),
                                    desired_input_layouts=(Replicate(), None, None, None, None)),
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=ROWS),
    "post_attention_layernorm": SequenceParallel(sequence_dim=0),
    "mlp": PrepareModuleInput(input_layouts=(ROWS,), desired_input_layouts=(Replicate(),)),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": SwiGLUDownParallel(output_layouts=ROWS),
}
"""Per decoder layer with sequence parallelism (torchtitan's plan, sequence dimension 0)."""


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


def tp_shard_dim(spec: ModelSpec, name: str, tp: int | None) -> int | None:
    """The dimension `apply_tp` splits parameter `name` along over `tp` ranks (None: every TP
    rank holds it whole: tp 1, the norms, K/V projections replicated over TP). `tp` None: the
    dimension whenever it is split."""
    if tp is not None and tp <= 1:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # vocabulary rows
        return 0
    if not name.startswith("model.layers."):
        return None
    module, _, kind = name.split(".", 3)[3].rpartition(".")
    style = LAYER_PLAN.get(module)
    if style is None or (tp is not None and tp_partial_names(spec, tp)(name)):
        return None
    if isinstance(style, ColwiseParallel):  # output features: the weight's rows and the bias
        return 0
    return 1 if kind == "weight" else None  # RowwiseParallel: the weight's input columns


def apply_tp(model: CausalLM, mesh: DeviceMesh, *, sequence_parallel: bool = True) -> CausalLM:
    """Parallelise `model` (one stage, on the meta device or materialised) over the 1-D TP
    mesh, in place; with `sequence_parallel` the residual stream is split by rows over TP
    (module docstring)."""
    spec, tp = model.spec, mesh.size()
    check_tp(spec, tp)
    plan = dict(SP_LAYER_PLAN if sequence_parallel else LAYER_PLAN)
    replicated = kv_replicated(spec, tp)
    if replicated:
        del plan["self_attn.k_proj"], plan["self_attn.v_proj"]
        head = mesh.get_local_rank() * spec.num_kv_heads // tp
        keep = functools.partial(_keep_columns, start=head * spec.head_dim, stop=(head + 1) * spec.head_dim)
    for layer in model.model.layers.values():
        if sequence_parallel:
            # before o_proj's own hook by registering first, not by `prepend`: torch 2.11's
            # compiler guarded a prepended hook by its position and failed on it
            layer.self_attn.o_proj.register_forward_pre_hook(functools.partial(_pad_rows, tp=tp))
        parallelize_module(layer, mesh, plan)
        if sequence_parallel:
            layer.self_attn.register_forward_pre_hook(_rows_of_the_row)  # after the gather
        if replicated:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                # the input is the block's Replicate DTensor: its gradient here is a partial sum
                proj.register_forward_pre_hook(_local_with_partial_grad)
                proj.register_forward_hook(keep)
    padded = -(-spec.vocab // tp) * tp
    if padded != spec.vocab:
        _pad_vocabulary(model, padded)
    outputs = ROWS if sequence_parallel else Replicate()
    if hasattr(model.model, "embed_tokens"):
        embed = model.model.embed_tokens
        parallelize_module(embed, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=outputs))
        if sequence_parallel:  # padding tokens no rank holds: their rows are zero
            embed.register_forward_pre_hook(functools.partial(_pad_tokens, tp=tp, fill=padded), prepend=True)
    if model.part.last:
        if sequence_parallel:
            parallelize_module(model.model.norm, mesh, SequenceParallel(sequence_dim=0))
        distribute_module(model.lm_head, mesh, _vocabulary_rows)
        model.lm_head.register_forward_pre_hook(functools.partial(_whole_head_input, mesh=mesh, layout=outputs))
        start = mesh.get_local_rank() * (padded // tp)
        real = None if padded == spec.vocab else max(0, spec.vocab - start)
        model.vocab_shard = model.lm_head.vocab_shard = VocabShard(group=mesh.get_group(), start=start, real=real)
    model.sequence_shards = tp if sequence_parallel else 1
    model.tie()  # both now hold vocabulary rows Shard(0): the head reuses the embedding's DTensor
    return model


def _pad_tokens(module, inputs, *, tp: int, fill: int):
    """Forward pre-hook of the embedding: the row's token ids padded to a multiple of tp with
    `fill`, an id outside every rank's vocabulary rows (their lookups are 0 on every rank)."""
    tokens_T = inputs[0]
    pad = -tokens_T.shape[0] % tp
    if pad == 0:
        return None
    return (torch.cat([tokens_T, tokens_T.new_full((pad,), fill)]), *inputs[1:])


@torch.compiler.disable
def _rows_of_the_row(module, inputs):
    """Forward pre-hook of self-attention after the gather: the row's own T tokens (the
    rotary tables' length), without the padding rows.

    Eager under a compiled layer (`runtime/compile.py`): the attention's graph break makes this
    hook a frame of its own, and a compiled frame that returns a view of its input DTensor is
    replayed by AOT autograd as `as_strided`, which DTensor refuses."""
    x_TD, rope = inputs[0], inputs[1]
    tokens = rope[0].shape[0]
    if x_TD.shape[0] == tokens:
        return None
    return (x_TD[:tokens], *inputs[1:])


def _pad_rows(module, inputs, *, tp: int):
    """Forward pre-hook of o_proj, before its input becomes a DTensor: zero rows up to a
    multiple of tp, so that its reduce-scatter hands every rank the same number of rows."""
    x_TX = inputs[0]
    pad = -x_TX.shape[0] % tp
    if pad == 0:
        return None
    return (F.pad(x_TX, (0, 0, 0, pad)), *inputs[1:])


def _local_with_partial_grad(module, inputs):
    """Forward pre-hook of a replicated K/V projection: the block's input DTensor (gathered
    under sequence parallelism) as a plain tensor, its gradient from this rank (its K/V head)
    marked partial, so it is summed over TP with the query projection's: by the gather's
    reduce-scatter, or without sequence parallelism by the block input's all-reduce."""
    x = inputs[0]
    if not isinstance(x, DTensor):
        return None
    return (x.to_local(grad_placements=(Partial(),)), *inputs[1:])


def _pad_vocabulary(model: CausalLM, padded: int) -> None:
    """Embedding and head with `padded` rows (same device and dtype; before materialising)."""
    spec = model.spec
    if hasattr(model.model, "embed_tokens"):
        old = model.model.embed_tokens.weight
        model.model.embed_tokens = nn.Embedding(padded, spec.hidden, device=old.device, dtype=old.dtype)
    if model.part.last:
        old = model.lm_head.weight
        model.lm_head = LMHead(spec.hidden, padded, bias=False, device=old.device, dtype=old.dtype)
    model.tie()


def _vocabulary_rows(name, module, mesh) -> None:
    """`distribute_module`'s partition of the LM head: its weight split by vocabulary rows
    (column-parallel logits), as ColwiseParallel splits it."""
    if name == "":
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(0)])))


def _whole_head_input(module, inputs, *, mesh, layout):
    """Forward pre-hook of the LM head: its input (this rank's rows under sequence
    parallelism, else whole) gathered whole and handed on as a plain tensor whose gradient from
    this rank's vocabulary columns is marked partial, so it is summed over TP (reduce-scattered
    back to the rank's rows, or all-reduced). The labels pass through. The head makes no
    logits DTensor: `loss.head_loss_sum` works on each rank's columns with its own
    collectives (`model.LMHead`)."""
    x = inputs[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    x = x.redistribute(mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))
    return (x, *inputs[1:])


def _keep_columns(module, inputs, out_TX, *, start: int, stop: int):
    """Forward hook: the rank's K/V head of a replicated projection's output."""
    return out_TX[:, start:stop]
