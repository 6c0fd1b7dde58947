"""Measure this device for a cost profile, and check a fast attention backend against the reference.

    measurer = TorchMeasurer(spec, layers=2, device="cuda", dtype=torch.bfloat16)
    fitted = measure_profile(measurer, profile_chunks(min_tokens=512, max_tokens=32768, max_context=131072),
                             head_token_counts(512, 16384), model_name=spec.name)    # cost/fit.py
    check = check_backend("varlen", device="cuda", dtype=torch.bfloat16)             # check.passed

What is timed is what a stage of the executor runs in its layers for one chunk (stage.py):
`CausalLM.run_layers` over the chunk's RowIndex with each slice's context K/V as leaves that
require grad, then the backward from the stage output (and into the context leaves). The
chunk's preparation, its rotary tables and its attention index, is made before the timing, as
the stage makes it once per chunk for all its layers: it is timed apart (`time_chunk_overhead`,
the simulator's per-chunk host term). Timed inside the layers' forward samples, as it was until
2026-11-28, half of it stood in each of the two layers measured, so a stage of L layers was
charged L/2 times it beside the per-chunk term. The model
is cut to `layers` decoder layers: the fit is per layer, and two layers keep a 32K-token chunk
with a 96K context well inside memory. The LM head (final norm, projection, cross-entropy in
float32 as loss.py computes it) is timed apart. Each measurement is `warmup` untimed runs then
the median of `repeats`, with the device synchronised around each pass.

Memory held from forward to backward: on CUDA the rise of `torch.cuda.memory_allocated` across
the forward (the stage input included, allocated inside the window as a received activation
would be); elsewhere the saved-tensor meter (memory.py), which counts what autograd keeps.
K/V bytes per token per layer are those of the k and v a layer returns, which the K/V store keeps.

Step terms (cost/time.StepTerms): `time_embed` times the embedding's forward and backward (the
table is the model's whole one); `time_chunk_overhead` what a stage does for a chunk around its
layers (ChunkLayout, positions, rotary tables, the attention's cu_seqlens) on a row of
OVERHEAD_SEGMENTS documents; `time_optimizer` one fused AdamW step (torch's `fused=True` on
CUDA) and one gradient norm (`get_total_norm`, clip_grad_norm_'s first half) over the profiled
model's real parameters, scaled by the whole model's parameter count over theirs (both are one
pass over each parameter's bytes, linear in the count).

`check_backend` runs one chunk that has everything the executor asks of attention: packed
documents, a slice whose context is two stored pieces, a second slice of the same sequence in
the same row, grouped-query heads (14 query / 2 K/V heads of 64, as Qwen2.5-0.5B). It compares
output and the gradients of q, k, v and the context pieces with the reference backend run in
float64, and reports the reference backend's own error in the tested dtype beside it.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from lengthwise.cost.fit import Timing
from lengthwise.plan.ir import Chunk
from lengthwise.runtime.attention import ChunkLayout, attend, resolve_backend, wants_varlen_index
from lengthwise.runtime.layout import RowIndex
from lengthwise.runtime.loss import chunk_positions
from lengthwise.runtime.memory import SavedTensorMeter
from lengthwise.runtime.compile import compile_layers, compile_wanted
from lengthwise.runtime.model import CHAIN_LAYERS, build_model
from lengthwise.specs import ModelSpec


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def elapsed(fn, device):
    """(seconds, result) of fn() with the device idle before and after."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


class HeldBytes:
    """Bytes that stay allocated across a `with` block: the CUDA allocator's count on CUDA, the
    saved-tensor meter's elsewhere (CPU allocations are not counted by torch). `peak_bytes()`
    is the highest allocation above the start since entering (transients included), asked
    later, e.g. after the backward."""

    def __init__(self, device, exclude=()):
        self.cuda = torch.device(device).type == "cuda"
        self.device, self.exclude, self.bytes = device, exclude, 0.0

    def __enter__(self) -> HeldBytes:
        if self.cuda:
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._meter = SavedTensorMeter(exclude=self.exclude).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            synchronize(self.device)
            self.bytes = float(torch.cuda.memory_allocated(self.device) - self._base)
        else:
            self._meter.__exit__(*exc)
            self.bytes = float(self._meter.current_bytes)

    def peak_bytes(self) -> float:
        if self.cuda:
            synchronize(self.device)
            return float(torch.cuda.max_memory_allocated(self.device) - self._base)
        return float(self._meter.peak_bytes)


@dataclass(kw_only=True)
class _ChunkInputs:
    index: RowIndex
    """The chunk's attention index, built once (as the stage builds it), outside the timing."""
    rope: tuple[torch.Tensor, torch.Tensor]
    """Its rotary tables, likewise."""
    contexts: list
    """Per layer, per segment: [(k, v)] context leaves."""
    leaves: list[torch.Tensor]


class TorchMeasurer:
    """Times chunks and the LM head on one device (the `Measurer` of cost/fit.py)."""

    def __init__(self, spec: ModelSpec, *, layers: int = 2, device="cpu", dtype=torch.float32,
                 backend: str = "auto", repeats: int = 3, warmup: int = 1, seed: int = 0,
                 compile: bool | None = None, compile_chain: bool = False):
        self.full_spec = spec
        self.compiled = compile_wanted(compile, device)
        self.chained = self.compiled and compile_chain
        if self.chained:  # one whole region, its call shared as a deep stage's regions share theirs
            layers = max(layers, CHAIN_LAYERS)
        self.spec = dataclasses.replace(spec, num_layers=min(layers, spec.num_layers))
        self.layers = self.spec.num_layers
        self.device, self.dtype, self.repeats, self.warmup = torch.device(device), dtype, repeats, warmup
        self.backend = resolve_backend(backend, self.device, dtype)
        self.model = build_model(self.spec, dtype=dtype, device=self.device, seed=seed)
        if self.compiled:  # chunk times as training runs them (warm-up calls compile)
            compile_layers(self.model, chain=self.chained)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def describe(self) -> dict:
        return {"device": device_name(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "backend": self.backend, "compiled": self.compiled, "chained": self.chained, "torch": torch.__version__,
                "repeats": self.repeats, "warmup": self.warmup}

    def _randn(self, *shape, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.dtype) * scale
        return t.requires_grad_(grad)

    def _inputs(self, chunk: Chunk) -> _ChunkInputs:
        layout = ChunkLayout.from_chunk(chunk)
        assert not any(layout.row_context), "profile chunks hold one slice per sequence"
        spec, leaves, contexts = self.spec, [], []
        for _ in range(self.layers):
            per_segment = []
            for c in layout.ctx_lens:
                pieces = [(self._randn(c, spec.num_kv_heads, spec.head_dim, grad=True),
                           self._randn(c, spec.num_kv_heads, spec.head_dim, grad=True))] if c else []
                leaves += [t for kv in pieces for t in kv]
                per_segment.append(pieces)
            contexts.append(per_segment)
        index = RowIndex.build(layout, self.device, varlen=wants_varlen_index(self.backend))
        rope = self.model.rope(chunk_positions(chunk, self.device), self.dtype)
        return _ChunkInputs(index=index, rope=rope, contexts=contexts, leaves=leaves)

    def _forward(self, inputs: _ChunkInputs, h_TD: torch.Tensor) -> torch.Tensor:
        out_TD, _ = self.model.run_layers(h_TD, layers=range(self.layers), rope=inputs.rope, layout=inputs.index,
                                          contexts=inputs.contexts, backend=self.backend)
        return out_TD

    def time_chunk(self, chunk: Chunk) -> Timing:
        inputs = self._inputs(chunk)
        return self._median([self._chunk_run(chunk, inputs) for _ in range(self.warmup + self.repeats)])

    def _chunk_run(self, chunk: Chunk, inputs: _ChunkInputs) -> Timing:
        """One forward and backward; the tensors it made are gone when it returns, so the next
        run's memory window starts from the same allocation."""
        with HeldBytes(self.device, exclude=self.model.parameters()) as held:
            h_TD = self._randn(chunk.num_tokens, self.spec.hidden, grad=True)
            t_f, out_TD = elapsed(lambda: self._forward(inputs, h_TD), self.device)
        grad_TD = self._randn(*out_TD.shape, scale=1e-2)
        t_b, _ = elapsed(lambda: out_TD.backward(grad_TD), self.device)
        for leaf in inputs.leaves:
            leaf.grad = None
        return Timing(fwd_s=t_f, bwd_s=t_b, activation_bytes=held.bytes, peak_bytes=held.peak_bytes())

    def time_head(self, tokens: int) -> Timing:
        labels = torch.randint(0, self.spec.vocab, (tokens,), generator=self.gen, device=self.device)
        return self._median([self._head_run(labels) for _ in range(self.warmup + self.repeats)])

    def _head_run(self, labels: torch.Tensor) -> Timing:
        with HeldBytes(self.device, exclude=self.model.parameters()) as held:
            h_TD = self._randn(labels.numel(), self.spec.hidden, grad=True)
            t_f, loss = elapsed(lambda: self.model.head_loss(h_TD, labels), self.device)
        t_b, _ = elapsed(loss.backward, self.device)
        return Timing(fwd_s=t_f, bwd_s=t_b, activation_bytes=held.bytes, peak_bytes=held.peak_bytes())

    def _median(self, runs: list[Timing]) -> Timing:
        """Median times of the runs after the warm-up; the memory figures of the last run."""
        timed = runs[self.warmup:]
        return Timing(fwd_s=statistics.median(r.fwd_s for r in timed), bwd_s=statistics.median(r.bwd_s for r in timed),
                      activation_bytes=runs[-1].activation_bytes, peak_bytes=runs[-1].peak_bytes)

    def time_embed(self, tokens: int) -> Timing:
        ids = torch.randint(0, self.spec.vocab, (tokens,), generator=self.gen, device=self.device)
        runs = []
        for _ in range(self.warmup + self.repeats):
            t_f, h_TD = elapsed(lambda: self.model.embed(ids), self.device)
            grad = self._randn(*h_TD.shape, scale=1e-2)
            t_b, _ = elapsed(lambda: h_TD.backward(grad), self.device)
            self.model.zero_grad(set_to_none=True)
            runs.append(Timing(fwd_s=t_f, bwd_s=t_b))
        return self._median(runs)

    def time_chunk_overhead(self) -> float:
        """Seconds of a stage's per-chunk work outside its layers, median of the repeats."""
        chunk = Chunk.parse("+".join(f"{i}[0:16]" for i in range(OVERHEAD_SEGMENTS)))

        def prepare():
            layout = ChunkLayout.from_chunk(chunk)
            rope = self.model.rope(chunk_positions(chunk, self.device), self.dtype)
            return RowIndex.build(layout, self.device, varlen=wants_varlen_index(self.backend)), rope

        times = [elapsed(prepare, self.device)[0] for _ in range(self.warmup + self.repeats)]
        return statistics.median(times[self.warmup:])

    def time_optimizer(self) -> tuple[float, float]:
        """(optimizer step, gradient norm) seconds for the whole model (module docstring)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.randn(p.shape, generator=self.gen, device=self.device, dtype=p.dtype) * 1e-3
        opt = torch.optim.AdamW(params, lr=1e-6, fused=self.device.type == "cuda")
        steps, norms = [], []
        for _ in range(self.warmup + self.repeats):
            steps.append(elapsed(opt.step, self.device)[0])
            norms.append(elapsed(lambda: torch.nn.utils.get_total_norm([p.grad for p in params]), self.device)[0])
        scale = self.full_spec.num_params / sum(p.numel() for p in params)
        for p in params:
            p.grad = None
        del opt
        return (scale * statistics.median(steps[self.warmup:]), scale * statistics.median(norms[self.warmup:]))

    @torch.no_grad()
    def kv_bytes_per_token_layer(self) -> float:
        """Bytes of the k and v one layer returns per token (what the K/V store keeps)."""
        chunk = Chunk.parse("0[0:16]")
        inputs = self._inputs(chunk)
        _, kv = self.model.run_layers(self._randn(16, self.spec.hidden), layers=range(1), rope=inputs.rope,
                                      layout=inputs.index, contexts=inputs.contexts[:1], backend=self.backend)
        k, v = kv[0]
        return (k.numel() * k.element_size() + v.numel() * v.element_size()) / 16


OVERHEAD_SEGMENTS = 64
"""Documents of the row whose per-chunk preparation `time_chunk_overhead` times."""


# ---- backend check -----------------------------------------------------------------------------

CHECK_CHUNK = "0[0:300]+1[0:77]+2[512:700]+2[700:900]+3[64:200]"
"""Packed documents, a slice after two stored context pieces followed by the next slice of the
same sequence in the row, and a slice with a short context."""
CHECK_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4, torch.float64: 1e-10}
"""Largest relative error (max |x - x_ref| / max |x_ref|) per tensor that passes, per dtype;
a tensor also passes within twice the reference backend's own error in that dtype."""


@dataclass(kw_only=True)
class BackendCheck:
    """A backend's attention output and gradients against the float64 reference."""

    backend: str
    dtype: str
    device: str
    chunk: str
    heads: tuple[int, int, int]
    """(query heads, K/V heads, head dim)."""
    error: dict[str, float]
    """Relative error per tensor: out, dq, dk, dv, dcontext."""
    reference_error: dict[str, float]
    """The reference backend's error in the same dtype, for scale."""
    tolerance: float

    @property
    def passed(self) -> bool:
        return all(e <= max(self.tolerance, 2 * self.reference_error[k]) for k, e in self.error.items())

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "passed": self.passed}


def check_backend(backend: str = "varlen", *, device="cuda", dtype=torch.bfloat16, heads: int = 14,
                  kv_heads: int = 2, head_dim: int = 64, seed: int = 0) -> BackendCheck:
    """Run CHECK_CHUNK's attention with `backend` in `dtype`, compare with float64."""
    layout = ChunkLayout.from_chunk(Chunk.parse(CHECK_CHUNK))
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.float64)  # noqa: E731
    q_lens = sum(layout.q_lens)
    tensors = {"q": rand(q_lens, heads, head_dim), "k": rand(q_lens, kv_heads, head_dim),
               "v": rand(q_lens, kv_heads, head_dim),
               "ctx": [rand(n, kv_heads, head_dim) for n in (256, 256, 256, 256, 64, 64)]}
    grad_out = rand(q_lens, heads, head_dim)
    truth = _attention_and_grads("reference", torch.float64, tensors, layout, grad_out)
    tested = _attention_and_grads(backend, dtype, tensors, layout, grad_out)
    ref_same_dtype = _attention_and_grads("reference", dtype, tensors, layout, grad_out)
    return BackendCheck(backend=resolve_backend(backend, torch.device(device), dtype),
                        dtype=str(dtype).removeprefix("torch."), device=device_name(device), chunk=CHECK_CHUNK,
                        heads=(heads, kv_heads, head_dim), error=_rel_errors(tested, truth),
                        reference_error=_rel_errors(ref_same_dtype, truth), tolerance=CHECK_TOLERANCE.get(dtype, 2e-2))


def _attention_and_grads(backend, dtype, tensors, layout: ChunkLayout, grad_out) -> dict[str, torch.Tensor]:
    q, k, v = (tensors[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v"))
    ctx = [t.detach().to(dtype).requires_grad_() for t in tensors["ctx"]]
    stored = [(ctx[0], ctx[1]), (ctx[2], ctx[3])]   # sequence 2's two stored pieces [0:256], [256:512]
    context = [[], [], stored, stored, [(ctx[4], ctx[5])]]
    out = attend(q, k, v, context, layout, backend=backend)
    out.backward(grad_out.to(dtype))
    dctx = torch.cat([t.grad.flatten() for t in ctx])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "dcontext": dctx}


def _rel_errors(tested: dict, truth: dict) -> dict[str, float]:
    return {name: float((tested[name].double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
            for name, ref in truth.items()}
