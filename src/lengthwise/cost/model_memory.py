"""CostModel's bytes per GPU: the activations a chunk keeps (with and without recomputation),
what a backward re-materialises and works on, K/V, model states, and a heterogeneous plan's
holdings and its exchange's buffers.

A mixin of `CostModel` (`cost/model.py`), its own module so that the model file stays one
screenful per concern; the per-token and per-parameter sizes themselves are `cost/memory.py`'s,
put here in the model's tensor-parallel layout and profile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import lengthwise.cost.memory as mem
from lengthwise.cost.flops import chunk_work, rank_works
from lengthwise.plan.ir import Chunk


@dataclass(frozen=True)
class ExchangeHolders:
    """How many GPUs of a heterogeneous strategy hold one element (`CostModel.hetero_holders`):
    one per (pipeline, CP rank) for the tp-split weights, every TP rank of those for the norms
    (held whole on each; K/V projections replicated over TP count as split here, though
    `stage_params` counts them whole on each TP rank: a heterogeneous plan with tp above the
    K/V heads is not modelled exactly), and for the embedding table the first and the last stage of each pipeline
    when it is tied."""

    split: int
    replicated: int
    table: int


class MemoryCosts:
    """Bytes per GPU of `CostModel` (mixed into it; not used alone)."""

    # ---- bytes per GPU ----
    @property
    def capacity_bytes(self) -> float:
        return self.cluster.gpu_memory_bytes * (1.0 - self.memory_reserve_frac)

    def activation_bytes_per_token(self, *, layers: int, tp: int = 1, recompute_layers: int = 0,
                                   recompute_mlp: int = 0, head: bool = False) -> float:
        """Bytes a chunk keeps per row token on a stage of `layers` layers, `recompute_layers` of
        them recomputed whole (each keeps its input) and `recompute_mlp` more their MLP block
        (each keeps all but `mem.mlp_recompute_saved_bytes_per_token_layer`), with the LM
        head's on the last stage (`head`), and what the stage keeps beside them
        (`mem.stage_kept_bytes_per_token`: the rotary tables, the output of a stage but the
        last)."""
        sp = self.sequence_parallel
        full = mem.activation_bytes_per_token_layer(self.model, tp, sp=sp)
        if self.profile and self.profile.activation_bytes_per_token_layer:
            full = self.profile.activation_bytes_per_token_layer / tp
        product = mem.product_bytes_per_token(self.model, tp) if self.swiglu_keeps_product else 0.0
        if not (self.profile and self.profile.activation_bytes_per_token_layer):
            full += product  # a measured profile measured its system's own layer
        kept = recompute_layers * mem.checkpoint_bytes_per_token_layer(self.model, tp, sp=sp)
        if recompute_mlp:
            kept -= recompute_mlp * (mem.mlp_recompute_saved_bytes_per_token_layer(self.model, tp, sp=sp) + product)
        head_b = mem.head_bytes_per_token(self.model, tp, sp=sp) if head else 0.0
        stage = mem.stage_kept_bytes_per_token(self.model, tp, layers=layers, head=head, sp=sp)
        return (layers - recompute_layers) * full + kept + head_b + stage

    def activation_bytes(self, chunk: Chunk, *, layers: int, tp: int = 1, cp: int = 1,
                         recompute_layers: int = 0, recompute_mlp: int = 0, head: bool = False) -> float:
        """Bytes held from the chunk's forward to its backward on the busiest GPU of the CP
        group: per token, and without CP the attention output's padded copy of each layer that
        keeps its activations (`attention_pad_bytes`); under CP each such layer also keeps the
        K/V its all-gather assembled of the chunk's sharded segments, whole, for its backward
        (`cp_kv_layer_bytes`: the executor gathers nothing again there). A layer that recomputes
        only its MLP block keeps both: its attention is not rerun."""
        if cp <= 1:
            return float(self.activation_bytes_rows(chunk_work(chunk).tokens, layers=layers, tp=tp,
                                                    recompute_layers=recompute_layers, recompute_mlp=recompute_mlp,
                                                    head=head))
        per_token = self.activation_bytes_per_token(layers=layers, tp=tp, recompute_layers=recompute_layers,
                                                    recompute_mlp=recompute_mlp, head=head)
        gathered = (layers - recompute_layers) * self.cp_kv_layer_bytes(chunk, tp=tp)
        return per_token * max(w.tokens for w in rank_works(chunk, cp)) + gathered

    def activation_bytes_rows(self, tokens, *, layers: int, tp: int = 1, recompute_layers: int = 0,
                              recompute_mlp: int = 0, head: bool = False):
        """`activation_bytes` of chunks without CP of these row tokens (a number or a float64
        array, elementwise: the same floats)."""
        per_token = self.activation_bytes_per_token(layers=layers, tp=tp, recompute_layers=recompute_layers,
                                                    recompute_mlp=recompute_mlp, head=head)
        return per_token * tokens + (layers - recompute_layers) * self.attention_pad_bytes(tokens, tp=tp)

    def attention_pad_bytes(self, tokens, *, tp: int = 1):
        """Bytes one layer keeps beyond its per-token figure for a row of `tokens` that tp does
        not divide (a number or an array, elementwise): the row is padded to the next multiple of
        tp (`runtime/parallel/tensor_parallel.py`), and the output projection keeps a padded copy
        of the attention output, whose unpadded original flash attention keeps too: q_dim / tp
        bf16 values per padded row (Qwen2.5-7B at tp 2: 4% of a layer's activations). The other
        tensors gain at most tp - 1 rows, left out. Under CP (rows padded otherwise) none, and
        none without sequence parallelism (rows are not padded)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        if tp <= 1 or not self.sequence_parallel:
            return np.zeros_like(tokens)
        padded = np.ceil(tokens / tp) * tp
        return np.where(padded > tokens, padded * (self.model.q_dim * mem.BYTES_BF16 / tp), 0.0)

    def recompute_transient_bytes_per_token(self, *, tp: int = 1, recompute_layers: int = 0,
                                            recompute_mlp: int = 0) -> float:
        """Bytes per token a backward re-materialises at once when its forward recomputed
        `recompute_layers` layers. The executor checkpoints layer by layer
        (`runtime/model.run_layers`, non-reentrant `torch.utils.checkpoint` per layer), so the
        backward reruns one layer's forward, consumes it and frees it before the next: one
        layer's activations less the input it kept, whatever the count (0 with no recomputation),
        and the SwiGLU's product, which a recomputed layer's nodes save and a layer keeping its
        activations does not (`mem.product_bytes_per_token`). The rerun stops once the last
        tensor the layer saved, the down projection's input (that product), is back
        (`cost/flops.py`), so all of them are held at once: the down projection's output
        and the layer's output are never made again. What the rerun's end holds beside them
        (silu(gate), and under sequence parallelism the gathered output gradient and the norm's
        rows) is the backward's working set (`mem.rerun_bytes_per_token`). With only MLP
        blocks recomputed, one block's (`mem.mlp_remat_bytes_per_token_layer`); with
        both, a whole layer's, the larger."""
        if recompute_layers <= 0:
            return self._mlp_remat_per_token(tp) if recompute_mlp > 0 else 0.0
        return (self.activation_bytes_per_token(layers=1, tp=tp)
                - self.activation_bytes_per_token(layers=1, tp=tp, recompute_layers=1)
                + mem.product_bytes_per_token(self.model, tp))

    def _mlp_remat_per_token(self, tp: int) -> float:
        return mem.mlp_remat_bytes_per_token_layer(self.model, tp, sp=self.sequence_parallel)

    def recompute_transient_bytes(self, chunk: Chunk, *, tp: int = 1, cp: int = 1, recompute_layers: int = 0,
                                  recompute_mlp: int = 0) -> float:
        """`recompute_transient_bytes_per_token` for the chunk's busiest GPU of the CP group."""
        if recompute_layers <= 0:
            if recompute_mlp <= 0:
                return 0.0
            return self._mlp_remat_per_token(tp) * max(w.tokens for w in rank_works(chunk, cp))
        if cp <= 1:  # the re-materialised layer's activations, its padded attention output's copy too
            tokens = chunk_work(chunk).tokens
            return float(self.activation_bytes_rows(tokens, layers=1, tp=tp)
                         - self.activation_bytes_rows(tokens, layers=1, tp=tp, recompute_layers=1)
                         + mem.product_bytes_per_token(self.model, tp) * tokens)
        per_token = self.recompute_transient_bytes_per_token(tp=tp, recompute_layers=recompute_layers)
        return per_token * max(w.tokens for w in rank_works(chunk, cp)) + self.cp_kv_layer_bytes(chunk, tp=tp)

    def head_backward_bytes(self, chunk: Chunk, *, tp: int = 1, cp: int = 1) -> float:
        """Bytes the loss's backward works on, on top of the kept activations, while the
        chunk's backward runs on the last stage (busiest GPU of the CP group)."""
        return float(mem.head_backward_bytes(self.model, max(w.tokens for w in rank_works(chunk, cp)), tp))

    def backward_work_bytes(self, chunk: Chunk, *, layers: int, tp: int = 1, cp: int = 1, head: bool = False,
                            remat: float = 0.0, rerun: bool = False) -> float:
        """Largest working set of the chunk's backward on a stage of `layers` layers (`head`:
        the last stage), on top of its kept activations (busiest GPU of the CP group): the
        loss's backward on the last stage, one layer's SwiGLU backward elsewhere, beside the
        `remat` bytes (`recompute_transient_bytes`) a recomputed layer re-materialises for it,
        and with `rerun` (every layer of the stage makes its MLP block again) the rerun's end
        (`cost/memory.py`)."""
        return float(self.backward_work_bytes_rows(max(w.tokens for w in rank_works(chunk, cp)), layers=layers,
                                                   tp=tp, head=head, remat=remat, rerun=rerun))

    def backward_work_bytes_rows(self, tokens, *, layers: int, tp: int = 1, head: bool = False, remat=0.0,
                                 rerun=False):
        """`backward_work_bytes` of rows of these tokens (a number or a float64 array,
        elementwise, as `remat` and `rerun`): per token, and on the last stage the blocked
        loss's backward (`mem.backward_work_bytes`)."""
        return mem.backward_work_bytes(self.model, tokens, tp, layers=layers, head=head, sp=self.sequence_parallel,
                                       remat=remat, rerun=rerun)

    def backward_work_bytes_per_token(self, *, layers: int, tp: int = 1, head: bool = False,
                                      rerun: bool = False) -> float:
        """`backward_work_bytes` per token (`mem.backward_work_bytes_per_token` in this model's
        tensor-parallel layout; `rerun`: the layers' MLP blocks are made again in backward)."""
        return mem.backward_work_bytes_per_token(self.model, tp, layers=layers, head=head, sp=self.sequence_parallel,
                                                 rerun=rerun)

    def head_forward_bytes(self, chunk: Chunk, *, tp: int = 1, cp: int = 1) -> float:
        """Bytes beside the kept activations while the chunk's forward runs the LM head: one
        block's bf16 logits and their fp32 copy (`mem.head_forward_bytes`; busiest GPU of the
        CP group)."""
        return float(mem.head_forward_bytes(self.model, max(w.tokens for w in rank_works(chunk, cp)), tp))

    def kv_bytes(self, num_tokens: int, *, layers: int, tp: int = 1, cp: int = 1) -> float:
        per = mem.kv_bytes_per_token_layer(self.model, tp)
        if self.profile and self.profile.kv_bytes_per_token_layer:
            per = self.profile.kv_bytes_per_token_layer
        return per * layers * num_tokens / cp

    def model_state_bytes(self, *, layers: int, tp: int = 1, dp: int = 1, zero: int = 1,
                          first: bool = False, last: bool = False) -> float:
        """Bytes of weights, gradients and optimizer states one GPU of a stage holds; `dp` is the
        number of ranks holding a replica of the stage's weights, over which ZeRO shards: data
        parallel pipelines times CP ranks (each CP rank holds the whole stage)."""
        params = mem.stage_params(self.model, layers=layers, tp=tp, first=first, last=last)
        return params * mem.state_bytes_per_param(dp, zero, grads=False) + self.grad_bytes(
            layers=layers, tp=tp, dp=dp, zero=zero, first=first, last=last)

    def grad_bytes(self, *, layers: int, tp: int = 1, dp: int = 1, zero: int = 1,
                   first: bool = False, last: bool = False) -> float:
        """The gradients' part of `model_state_bytes`: fp32 accumulators of `mem.grad_params`
        elements (the embedding's whole table on the first stage), unsharded at every ZeRO stage
        while the step accumulates them (`cost/memory.py`; `dp` and `zero` change nothing)."""
        return mem.grad_params(self.model, layers=layers, tp=tp, first=first, last=last) * mem.GRAD_BYTES_PER_PARAM

    def hetero_holders(self, pipelines) -> "ExchangeHolders":
        """How many GPUs hold each element of a heterogeneous strategy whose pipelines have the
        (tp, pp, cp) of `pipelines` (`ExchangeHolders`)."""
        pipelines = [tuple(p)[:3] for p in pipelines]
        tied = self.model.tied_embeddings
        return ExchangeHolders(split=sum(cp for _, _, cp in pipelines),
                               replicated=sum(tp * cp for tp, _, cp in pipelines),
                               table=sum(cp * (2 if tied and pp > 1 else 1) for _, pp, cp in pipelines))

    def hetero_owned(self, *, layers: int, tp: int = 1, first: bool = False, last: bool = False,
                     holders: "ExchangeHolders") -> float:
        """Parameter elements one GPU of a stage owns in a heterogeneous plan
        (runtime/parallel/hetero.py: every element owned by one of its h holders, each holder
        owning 1/h of what it holds): its tp-split weights over `holders.split`, its whole norms
        over `holders.replicated`, its embedding table (tied: on the first and the last stage)
        over `holders.table`. Exact when h divides every held band's width."""
        m = self.model
        norms = layers * 2 * m.hidden + (m.hidden if last else 0)
        split = (layers * m.params_per_layer - layers * 2 * m.hidden) / tp / holders.split
        table = m.vocab * m.hidden / tp
        if first:
            split += table / holders.table
        if last and not (first and m.tied_embeddings):
            split += table / (holders.table if m.tied_embeddings else holders.split)
        return split + norms / holders.replicated

    def hetero_state_bytes(self, *, layers: int, tp: int = 1, first: bool = False, last: bool = False,
                           holders: "ExchangeHolders") -> float:
        """Model-state bytes one GPU of a heterogeneous plan holds, as the executor lays them out
        (`runtime/train/dist_hetero.py`, `runtime/parallel/hetero.py`): its stage's weights in
        the run's dtype (bf16, 2 bytes per held parameter), their gradients in the same dtype
        (`hetero_grad_bytes`: autograd accumulates them in the parameters' bf16 and they stay
        local, unsummed, until the push), and for the elements it owns (`hetero_owned`, about 1/d
        of what it holds, d holders) the fp32 master weights and AdamW's two moments (12). The
        exchange keeps no index maps (it copies strided blocks); its push's and pull's buffers at
        the step's end are `exchange_transient_bytes`."""
        held = mem.stage_params(self.model, layers=layers, tp=tp, first=first, last=last)
        owned = self.hetero_owned(layers=layers, tp=tp, first=first, last=last, holders=holders)
        return (held * mem.BYTES_BF16 + self.hetero_grad_bytes(layers=layers, tp=tp, first=first, last=last)
                + mem.OPTIMIZER_BYTES_PER_PARAM * owned)

    def hetero_grad_bytes(self, *, layers: int, tp: int = 1, first: bool = False, last: bool = False) -> float:
        """The gradients' part of `hetero_state_bytes`: bf16, of `mem.grad_params` elements (the
        embedding's whole table on the first stage, until `dp.match_grad_layouts` slices it)."""
        return mem.grad_params(self.model, layers=layers, tp=tp, first=first, last=last) * mem.BYTES_BF16

    @staticmethod
    def exchange_transient_bytes(*, held: float, owned: float) -> float:
        """Largest working set of a heterogeneous plan's step end beyond `hetero_state_bytes`
        (`train/dist_hetero.py`; activations are freed by then): a GPU holding `held` parameter
        elements and owning `owned` of them (its master shard), receiving as owner each owned
        element from each of its holders, itself included: `held` in all (owned_c x h_c = held_c
        for every holder count h_c). The push holds the flattened bf16 gradients (2 bytes per held
        element) and the received bf16 slices (2 per received) throughout, beside first the
        owner-ordered send buffer (2 per held), released after the all-to-all, then the fp32
        summed shard (4 per owned) the received slices are added into in place; the gradient
        norm squares a float64 copy of the shard (4 + 16 per owned); the pull, beside the shard,
        fills a bf16 send buffer from the masters it owns (2 per received) and receives the bf16
        weights (2 per held), then releases the send buffer and reorders the weights into a copy
        (2 per held)."""
        received = held
        push = 2 * held + 2 * received + max(2 * held, 4 * owned)
        norm = 20 * owned
        pull = 4 * owned + max(2 * received + 2 * held, 4 * held)
        return max(push, norm, pull)

    @staticmethod
    def exchange_sent_bytes(*, held: float, owned: float) -> float:
        """Bytes one GPU hands to the exchange's two all-to-alls in a step, less what it sends
        itself, for a GPU holding `held` parameter elements and owning `owned` of them: on the
        push its bf16 gradients of the elements others own (held - owned); on the pull, as owner,
        each owned element's bf16 weight to its h - 1 other holders: sum of owned_c (h_c - 1) =
        held - owned again. Exact when every held band's width is a multiple of its holder count,
        within a column per shard row and segment otherwise. (`exchange_bytes` counts instead what
        passes the GPU's link, sent on the push and received on the pull: the same.)"""
        return 2 * (held - owned) * mem.BYTES_BF16
