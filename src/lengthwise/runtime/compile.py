"""Regional compilation: each decoder layer's forward under `torch.compile`, not the model.

    compile_layers(model)                       # inductor, the default on CUDA
    compile_layers(model, backend="aot_eager")  # the CPU exactness test's choice

One layer is the region (torchtitan's choice): every layer runs the same code, so one compiled
graph serves them all, and compile time does not grow with depth. The token dimension is
dynamic (`dynamic=True`), so chunks of other lengths reuse the graph instead of recompiling
each step. What compiles: norms, projections, rotary embedding, residuals, SwiGLU (the layer's
autograd Functions, `layer_ops.py`, traced with their backwards): a dozen small kernels per
layer fused. On a host with little arithmetic per layer a compiled region's call (guards,
AOTAutograd's wrappers, the graph's own Python) costs about what the eager Functions' calls do
(benchmarks/results/host_overhead.json): compiling pays on the device, where the fused kernels
save launches and memory traffic.

The LM head's loss (`loss.head_loss_sum`, on the last stage) is compiled too, but not as a
region: its block loop and matmuls stay eager, and in backward the elementwise work of each
block between the matmuls (the softmax gradient) is one compiled function, the wide logits
never written (`loss._BlockedHeadLoss` says what that measured, and why forward stays eager).

Left out, by `torch.compiler.disable` on `attention.attend`: the attention itself. Its
backends loop in Python over the row's calls (data from the plan, not tensors), call private
kernels from custom autograd Functions, and read the state store's K/V buffers; tracing them
would guard on every chunk's layout and recompile per plan. The layer's graph breaks there
into the part before attention and the part after (a chained region, below, holds the flash
backends' attention as an operator instead, `row_op.py`).

Under tensor parallelism the embedding hands its output on as a collective not yet waited for;
`compile_layers` makes it a plain tensor before the first compiled layer sees it (`_settled`),
else that layer's graph drops the embedding's gradient.

The layer objects stay where they are (names unchanged for checkpoints; FSDP2 and tensor
parallelism hooks on the modules run as before): a layer with `compile_backend` set runs its
`attention_input` and `attention_output` through compiled functions that every layer shares
(its `block`, as module calls, under tensor parallelism's hooks).

Chained (`compile_layers(..., chain=True)`, off by default): `CausalLM.run_layers` runs a
stage's plain layers up to four in one compiled region (`model.CHAIN_LAYERS`), the attention
inside it as an operator (`row_op.flash_row`, whose backward is an operator too: opaque nodes
that need no guard on the chunk's structure, found by a handle that is a graph input). A layer
and chunk then cost a quarter of a compiled call forward and a quarter of one backward instead
of two each, and the region's inductor code calls the attention directly, without an eager autograd
Function around it. On a CPU a small row (`flash_cpu.DENSE_ENTRIES`) is not an operator but
traced whole (`flash_cpu.dense_row`: one masked flash call over the store context and the
row's own keys, its bias built once per chunk), so the region holds nothing opaque and no
Python of the row runs between its layers. For the flash backends (`cpu-flash`, `varlen`); the
reference backend and context parallelism's attention run as before, as do layers with hooks
(FSDP2, tensor parallelism) or recomputation. Measured on this CPU (inductor, the tiny step,
benchmarks/results/host_overhead.json, 8-layer step minus 4-layer step, one run): 544 us a
layer and chunk chained, 941 with the attention as an operator (the GPU's path), against 1,400
compiled apart and 1,448 eager (1,759 before the hot-path work: 3.24x, 1.87x with the
operator); PyTorch's own floor, each plain layer compiled whole with SDPA inside, 665, and four
plain layers in one compiled function, 369. The warm-up with compilation took 15.8 s against
5.4. Its costs: the region unrolls its layers, so
its graph compiles longer, and a stage whose layer count is no multiple of four compiles one
graph more for the rest; a chunk with another number of context pieces compiles another graph
(0 or 1 split sequence a chunk in practice). Not yet measured on a GPU, where the host time of
short chunks is what a ChunkFlow step waits on (benchmarks/results/gpu-2026-11-28-nvidia-h200/
breakdown/: the device idle 23% of a 1.5B ChunkFlow step at ChunkSize 8192); `bash
benchmarks/gpu_suite.sh --experiments` compares it there. `lengthwise profile --compile-chain`
measures four layers (one whole region) however few `--layers` asks for, so a layer's host floor
holds a quarter of a region's call, as in a deep stage, not half of it.

Without duck sizing: by default the symbolic-shape engine gives two sizes that happen to be
equal when first seen one symbol, so a first chunk of as many tokens as the head dimension (or
a TP rank's rows equal to the hidden size) compiled a graph for that coincidence and compiled
again at the next chunk length (two graphs per region instead of one, and the recompile
limit reached sooner). `compile_layers` turns duck sizing off for the process
(`torch.fx.experimental._config.use_duck_shape`, read when a graph is compiled): the token
count stays one symbol of its own whatever it equals.

What a compiled layer keeps for backward is AOTAutograd's partitioner's choice, not the
autograd Functions' `save_for_backward`: it traces forward and backward into one graph and
decides which values to keep and which to compute again. By default it never recomputes a value
that backward would have to write out (`ban_recompute_materialized_backward`: an input of a
matmul), so the SwiGLU's product, which the down projection's weight gradient reads, was kept
beside gate and up, the very tensor `layer_ops.SwiGLUDown` exists not to keep: 3 ffn-sized
tensors a layer (on the H200 Qwen2.5-1.5B packing peaked at 67.7 GiB compiled, the dry run's
eager figure without that saving; measured on CPU with saved-tensor hooks, a Qwen2.5-0.5B layer
compiled by inductor kept 40,768 bytes a token, eager 31,040). `compile_layers` lifts that ban
for the process: the partitioner then makes the product again from gate and up (as the eager
Function does) and the norms' outputs from their inputs, pointwise work fused into backward's
kernels: 27,456 bytes a token (tests/test_runtime_execute.py checks what a compiled layer keeps).
"""

from __future__ import annotations

import functools

import torch
import torch._dynamo.config  # noqa: F401  (recompile_limit)
import torch._functorch.config  # noqa: F401  (ban_recompute_materialized_backward)
import torch.fx.experimental._config  # noqa: F401  (use_duck_shape)
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from lengthwise.errors import UserError

COMPILE_CHOICES = ("auto", "on", "off")
RECOMPILE_LIMIT = 64
"""Graphs one compiled function may hold before dynamo runs it eager from then on (PyTorch's
default is 8). A layer region legitimately holds several: with and without grad (ChunkFlow's
forwards), a row count a multiple of tp or not (tensor parallelism's padding), and one per range
of chunk lengths that inductor's generated code specialises on (its size guards: on CPU, chunks
of up to 4,096 tokens and longer ones compile apart; on the H200 the 1.5B step that first held
a 1,512-token chunk took 6.6 s against 0.9 s, the same chunks recompiling on CPU). Past 8 the layers would silently run eager for the rest of
training; a bounded few more graphs cost seconds once."""


def compile_wanted(choice: str | bool | None, device) -> bool:
    """--compile on/off, or auto (None): on on CUDA, off elsewhere (on a CPU the compile time
    is not paid back by a short run, and inductor's CPU kernels need a C++ compiler)."""
    if isinstance(choice, bool):
        return choice
    if choice in (None, "auto"):
        return torch.device(device).type == "cuda"
    if choice not in COMPILE_CHOICES:
        raise UserError(f"--compile {choice!r}: use one of {', '.join(COMPILE_CHOICES)}")
    return choice == "on"


def compile_layers(model, *, backend: str = "inductor", chain: bool = False) -> None:
    """Compile the forward of every decoder layer `model` holds, in place. `chain`: up to four
    layers in one compiled region, attention included (module docstring, "Chained")."""
    for layer in model.model.layers.values():
        layer.compile_backend = backend
        layer.compile_chain = chain
    head = getattr(model, "lm_head", None)
    if head is not None:  # the loss blocks' elementwise work (runtime/loss.py)
        head.compile_backend = backend
    torch.fx.experimental._config.use_duck_shape = False  # see the module docstring
    torch._functorch.config.ban_recompute_materialized_backward = False  # the same
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    embed = getattr(model.model, "embed_tokens", None)
    if embed is not None and not getattr(embed, "settles_output", False):
        embed.register_forward_hook(_settled)
        embed.settles_output = True


def _settled(module, inputs, out_TD):
    """Forward hook of the embedding (registered after tensor parallelism's): its output as a
    plain tensor. Under tensor parallelism the embedding hands on its reduce (reduce-scatter or
    all-reduce) not yet waited for, an `AsyncCollectiveTensor`; fed to the first compiled layer,
    AOT autograd waits for it inside the graph but drops its gradient edge (torch 2.13,
    aot_eager: the embedding's gradient came back zero, every other one exact). A copy made in
    eager waits and keeps the edge: one [T/tp, D] copy per chunk of the first stage."""
    return out_TD.clone() if isinstance(out_TD, AsyncCollectiveTensor) else None


@functools.cache
def compiled(fn, backend: str):
    """`fn` under torch.compile with `backend`, dynamic shapes; one per (function, backend), so
    every layer shares it (the layer is an argument: its parameters are graph inputs)."""
    return torch.compile(fn, dynamic=True, backend=backend)
