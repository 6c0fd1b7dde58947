"""What the GPU benchmarks share: the device, its cost profile, sampled batches, timed steps, results.

    from bench_common import Device, acquire_profile, sample_batches, write_results
    dev = Device.pick("auto", "auto")            # cuda + bfloat16 when present, else cpu + float32
    profile, path = acquire_profile(spec, dev, tiny=False, given=None, out_dir=RESULTS)

Used by bench_gpu_finetune.py and sim_fidelity.py (scripts run as `python benchmarks/X.py`, so
this folder is on sys.path). On a GPU a profile is measured with the same grid as `lengthwise
profile`'s defaults unless a file is given; on CPU (`--tiny`) a small grid makes it take seconds.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lengthwise.cost import Profile
from lengthwise.cost.fit import head_token_counts, measure_profile, profile_chunks
from lengthwise.files import write_atomic
from lengthwise.runtime.profile import TorchMeasurer, device_name, synchronize
from lengthwise.specs import ClusterSpec, ModelSpec, cluster_preset
from lengthwise.workloads.sampler import GlobalBatchSampler
from lengthwise.workloads.source import profile_source

RESULTS = Path(__file__).parent / "results"
HOPPER_PEAK_TFLOPS = 989.0
"""Dense bf16 peak of an H100 SXM and of an H200 (the same tensor cores)."""


@dataclass(kw_only=True)
class Device:
    """Where a benchmark runs."""

    device: torch.device
    dtype: torch.dtype
    name: str
    """torch.cuda.get_device_name, or "cpu (...)"."""

    @classmethod
    def pick(cls, device: str, dtype: str) -> Device:
        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
        if dtype == "auto":
            dtype = "bfloat16" if dev.type == "cuda" else "float32"
        return cls(device=dev, dtype=getattr(torch, dtype), name=device_name(dev))

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def cluster(self) -> ClusterSpec:
        """One GPU of the matching preset with this device's real memory (cpu preset on CPU)."""
        if not self.cuda:
            return cluster_preset("cpu", 1)
        total = torch.cuda.get_device_properties(self.device).total_memory / 2**30
        return dataclasses.replace(cluster_preset("h100", 1), name=self.name, gpu_memory_gb=total)

    def peak_tflops(self, override: float | None) -> float:
        if override:
            return override
        if any(tag in self.name for tag in ("H100", "H200", "GH200")):
            return HOPPER_PEAK_TFLOPS
        return self.cluster().peak_tflops

    def describe(self) -> dict:
        return {"device": self.name, "device_type": self.device.type, "dtype": str(self.dtype).removeprefix("torch."),
                "torch": torch.__version__, "python": platform.python_version(),
                "cuda": torch.version.cuda if self.cuda else None}


def acquire_profile(spec: ModelSpec, dev: Device, *, tiny: bool, given: str | None, out_dir: Path,
                    seed: int = 0) -> tuple[Profile, str]:
    """The profile file given, or one measured now and written to out_dir."""
    if given:
        return Profile.load(given), given
    if tiny:
        chunks = profile_chunks(min_tokens=16, max_tokens=128, max_context=512)
        heads, kw = head_token_counts(16, 128), {"layers": 1, "repeats": 1, "warmup": 0}
    else:
        chunks = profile_chunks(min_tokens=512, max_tokens=32768, max_context=131072)
        heads, kw = head_token_counts(512, 16384), {"layers": 2, "repeats": 3, "warmup": 1}
    measurer = TorchMeasurer(spec, device=dev.device, dtype=dev.dtype, seed=seed, **kw)
    fitted = measure_profile(measurer, chunks, heads, model_name=spec.name, seed=seed)
    del measurer
    empty_cache(dev)
    path = out_dir / f"profile-{spec.name}-{slug(dev.name)}.json"
    write_atomic(path, json.dumps(fitted.profile.to_dict(), indent=1))
    return fitted.profile, str(path)


def sample_batches(workload: str, context: int, batch_size: int, count: int, seed: int,
                   overlong: str = "truncate") -> list[list[int]]:
    """`count` global batches of `batch_size` sequence lengths, cut to the context length."""
    sampler = GlobalBatchSampler(profile_source(workload, context, overlong), seed=seed, batch_size=batch_size)
    return [list(sampler.next_batch().lengths) for _ in range(count)]


def with_long_sequence(batches: list[list[int]], low: int, high: int, *, seed: int) -> list[list[int]]:
    """Each batch with one sampled sequence, at a random place, replaced by one of low..high
    tokens (uniform): every step then holds a sequence longer than any chunk, which the
    chunkflow-eval profile alone rarely gives (its 64-sequence batches seldom pass 4K)."""
    rng = random.Random(seed)
    out = []
    for lengths in batches:
        at = rng.randrange(len(lengths))
        out.append([*lengths[:at], rng.randint(low, high), *lengths[at + 1:]])
    return out


def random_token_ids(lengths: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def timed(fn, dev: Device):
    """(seconds, result) of fn() with the device synchronised around it."""
    synchronize(dev.device)
    start = time.perf_counter()
    out = fn()
    synchronize(dev.device)
    return time.perf_counter() - start, out


def allocated(dev: Device) -> int:
    return torch.cuda.memory_allocated(dev.device) if dev.cuda else 0


def empty_cache(dev: Device) -> None:
    if dev.cuda:
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def mape(predicted: list[float], measured: list[float]) -> float:
    """Mean absolute percentage error, as a fraction."""
    return statistics.fmean(abs(p - m) / m for p, m in zip(predicted, measured) if m > 0)


def slug(text: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def write_results(path: Path | str, payload: dict, script: str, argv: list[str]) -> None:
    """The results JSON with the command that made it and when."""
    payload = {**payload, "command": " ".join(["python", f"benchmarks/{Path(script).name}", *argv]),
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    write_atomic(path, json.dumps(payload, indent=1))
