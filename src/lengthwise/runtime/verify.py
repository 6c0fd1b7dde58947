"""Check that executing a StepPlan gives the loss and gradients of plain, unpacked training.

    result = verify_plan(plan, dtype=torch.float64, seed=0)
    result.passed, result.max_rel_grad_diff

The oracle is Hugging Face transformers' own `LlamaForCausalLM` / `Qwen2ForCausalLM` built
from the same config with the same weights, run on every sequence alone (no packing, no
splitting); the loss is the sum of token cross-entropies over the batch divided by the
batch's loss tokens. Without transformers installed, the oracle is this package's model run
unpacked (`oracle="unpacked"`), which still checks packing, splitting, state hand-over,
pipelining and accumulation, but not the model's maths.

Hugging Face computes RMSNorm and the rotary tables in float32 even in a float64 model, which
limits agreement to about 1e-7 relative (measured: 2.4e-7 on a 2-layer model). In float64 the
oracle therefore runs those two modules in float64 (`_promote_hf_internals`); projections,
attention (SDPA), MLP, embeddings and weight loading stay Hugging Face's code.

Gradient difference of a parameter: max |g - g_ref| over its elements, relative: divided by
max |g_ref| of that parameter; the reported numbers are the maxima over parameters.
Tolerances (relative) per dtype, `TOLERANCE`: float64 1e-9, float32 1e-4, bfloat16 1e-1.
Measured on the tiny and tiny-qwen presets, chunkflow plan (chunk 64, K=1, pp=2), lengths
200,30,17,60,5, seeds 0-1: float64 2.5e-15, float32 1.3e-6, bfloat16 2.8e-2 (gradients
accumulate in bfloat16 across chunks). A single wrong mask bit or label shows as O(1).
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass

import torch

from lengthwise.plan.ir import StepPlan
from lengthwise.runtime.execute import run_step, unpacked_plan
from lengthwise.runtime.loss import IGNORE, token_loss_sum
from lengthwise.runtime.compile import compile_layers, compile_wanted
from lengthwise.runtime.model import CausalLM, build_model, inverse_frequencies
from lengthwise.runtime.weights import hf_config_dict

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 1e-1}
"""Largest relative gradient (and loss) difference that passes, per dtype."""

ORACLES = ("auto", "transformers", "unpacked")


@dataclass(kw_only=True)
class VerifyResult:
    """Executor against oracle on one global batch."""

    loss: float
    """The executor's loss (sum of token cross-entropies / loss tokens)."""
    reference_loss: float
    """The oracle's loss."""
    max_abs_grad_diff: float
    """Largest |g - g_ref| over all parameters' elements."""
    max_rel_grad_diff: float
    """Largest per-parameter max |g - g_ref| / max |g_ref|."""
    worst_param: str
    """The parameter with the largest relative difference."""
    oracle: str
    """transformers, or unpacked (this package's model, each sequence alone)."""
    tolerance: float
    """Relative tolerance used for `passed`."""

    @property
    def loss_rel_diff(self) -> float:
        return abs(self.loss - self.reference_loss) / max(abs(self.reference_loss), 1e-300)

    @property
    def passed(self) -> bool:
        return self.max_rel_grad_diff <= self.tolerance and self.loss_rel_diff <= self.tolerance

    def to_dict(self) -> dict:
        return {"loss": self.loss, "reference_loss": self.reference_loss,
                "max_abs_grad_diff": self.max_abs_grad_diff, "max_rel_grad_diff": self.max_rel_grad_diff,
                "worst_param": self.worst_param, "oracle": self.oracle, "tolerance": self.tolerance,
                "passed": self.passed}


def random_tokens(lengths: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def verify_plan(plan: StepPlan, *, dtype: torch.dtype = torch.float64, backend: str = "auto",
                seed: int = 0, oracle: str = "auto", device="cpu", compile: bool | None = None,
                compile_backend: str = "inductor", head_block_bytes: int | None = None,
                compile_chain: bool = False) -> VerifyResult:
    """Random weights and tokens (seeded), the plan's loss and gradients against the oracle's
    (`compile`: runtime/compile.compile_wanted, under `compile_backend`, chained with
    `compile_chain`; `head_block_bytes`: the LM head's block, `model.LMHead.block_bytes`)."""
    model = build_model(plan.model, dtype=dtype, device=device, seed=seed)
    if compile_wanted(compile, device):
        compile_layers(model, backend=compile_backend, chain=compile_chain)
    model.lm_head.block_bytes = head_block_bytes
    token_ids = random_tokens(plan.lengths, plan.model.vocab, seed + 1)
    loss = run_step(model, plan, token_ids, backend=backend)
    grads = {name: p.grad for name, p in model.named_parameters()}
    oracle = resolve_oracle(oracle)
    if oracle == "transformers":
        ref_loss, ref_grads = transformers_loss_and_grads(model, token_ids)
    else:
        ref_loss, ref_grads = unpacked_loss_and_grads(model, token_ids, backend=backend)
    abs_diff, rel_diff, worst = compare_grads(grads, ref_grads)
    return VerifyResult(loss=float(loss), reference_loss=float(ref_loss), max_abs_grad_diff=abs_diff,
                        max_rel_grad_diff=rel_diff, worst_param=worst, oracle=oracle,
                        tolerance=TOLERANCE.get(dtype, 1e-1))


def resolve_oracle(oracle: str) -> str:
    """`auto` -> transformers when it is installed, else unpacked."""
    assert oracle in ORACLES, oracle
    if oracle != "auto":
        return oracle
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "unpacked"
    return "transformers"


def compare_grads(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, float, str]:
    """(max abs difference, max per-parameter relative difference, worst parameter name)."""
    assert grads.keys() == ref.keys(), sorted(set(grads) ^ set(ref))
    max_abs, max_rel, worst = 0.0, 0.0, ""
    for name, g in grads.items():
        diff = (g.double() - ref[name].double().to(g.device)).abs().max().item()
        rel = diff / max(ref[name].double().abs().max().item(), 1e-300)
        max_abs = max(max_abs, diff)
        if rel >= max_rel:
            max_rel, worst = rel, name
    return max_abs, max_rel, worst


def unpacked_loss_and_grads(model: CausalLM, token_ids: list[torch.Tensor], *, backend: str):
    """This package's model on each sequence alone (a copy, so `model`'s grads stay)."""
    twin = copy.deepcopy(model)
    twin.zero_grad(set_to_none=True)
    lengths = [t.numel() for t in token_ids]
    loss = run_step(twin, unpacked_plan(lengths, model.spec), token_ids, backend=backend)
    return float(loss), {name: p.grad for name, p in twin.named_parameters()}


def transformers_loss_and_grads(model: CausalLM, token_ids: list[torch.Tensor]):
    """Hugging Face's model with `model`'s weights, each sequence alone, summed CE / loss tokens."""
    hf = build_hf_twin(model)
    device = next(model.parameters()).device
    loss_tokens = sum(max(t.numel() - 1, 0) for t in token_ids)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for ids in token_ids:
        ids = ids.to(device)
        logits = hf(input_ids=ids[None]).logits[0]
        labels = torch.cat([ids[1:], ids.new_full((1,), IGNORE)])
        part = token_loss_sum(logits, labels) / loss_tokens
        part.backward()
        total += part.detach().double()
    return float(total), {name: p.grad for name, p in hf.named_parameters()}


def build_hf_twin(model: CausalLM):
    """transformers' model for `model.spec`, SDPA attention, with a copy of `model`'s weights."""
    import transformers

    cfg = hf_config_dict(model.spec)
    config = transformers.AutoConfig.for_model(**cfg)
    param = next(model.parameters())
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    hf = hf.to(device=param.device, dtype=param.dtype)
    hf.load_state_dict(model.state_dict(), strict=True)
    if param.dtype == torch.float64:
        _promote_hf_internals(hf, model.spec)
    return hf


def _promote_hf_internals(hf, spec) -> None:
    """Run Hugging Face's RMSNorm and rotary tables in float64 (they hard-code float32)."""
    patched = 0
    for module in hf.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = types.MethodType(_rmsnorm_float64, module)
            patched += 1
        elif kind.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(lambda self, x, position_ids: _rotary_float64(self, x, position_ids, spec), module)
            patched += 1
    assert patched >= 2, "transformers' module names changed: update _promote_hf_internals"


def _rmsnorm_float64(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rotary_float64(self, x, position_ids, spec):
    # The frequencies (with Llama-3 scaling) in float64; tests/test_runtime_model.py checks
    # this formula against transformers' own in float32.
    inv_freq = inverse_frequencies(head_dim=2 * self.inv_freq.shape[-1], theta=spec.rope_theta,
                                   scaling=spec.rope_scaling, dtype=torch.float64, device=x.device)
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(x.dtype), angles.sin().to(x.dtype)
