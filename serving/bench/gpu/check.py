"""Check, on the GPU machine, that the pack installed and that everything the engine benchmark needs imports.

Run after the pack's install, with the install folder and the repository on PYTHONPATH:

    sh .gpu-pack/install.sh /tmp/site
    PYTHONPATH=/tmp/site:. python3 -m serving.bench.gpu.check

It stops at the first thing that makes the rest meaningless (no pack folder, another Python than the wheels were
chosen for, another torch than vLLM was built against, no CUDA GPU), with one line; then imports every module of
IMPORT_CHECK and prints one line per failure; on the GPU it then runs two of the stripped libraries' kernels against
torch (kernel_smoke). Exit 0 when all is well, 2 otherwise. `--no-gpu` skips the GPU parts and lets vLLM's CUDA
libraries fail to load, for a check on a machine without a GPU or driver.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from pathlib import Path

# The modules the engine benchmark loads on the GPU: vLLM's offline engine (V1 engine core in-process, uniproc
# executor, GPU worker and model runner, Llama, the FlashAttention and Triton attention backends, the sampler,
# the structured-output manager, the logits processors) and our benchmark, scheduler and command line.
IMPORT_CHECK: tuple[str, ...] = (
    "vllm",
    "vllm.LLM",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.model_executor.models.llama",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.sample.sampler",
    "vllm.v1.core.sched.async_scheduler",
    "vllm.v1.structured_output",
    "vllm.v1.sample.logits_processor",
    "vllm._C_stable_libtorch",
    "vllm.vllm_flash_attn",
    "serving.engine.scheduler",
    "serving.engine.profile",
    "serving.bench.engine.bench",
    "serving.bench.engine.replay",
    "serving.bench.engine.exactlen",
    "serving.cli",
)
PYTHON = (3, 12)
TORCH_SERIES = "2.11."
# What vLLM's CUDA build says when its libraries cannot load for want of a GPU driver: expected under --no-gpu (the
# last is vllm.vllm_flash_attn's own error once both of its libraries failed to load).
NO_DRIVER_MARKERS = ("libcuda.so", "CUDA driver", "no CUDA GPUs", "Found no NVIDIA driver",
                     "requires the CUDA flash attention extensions")
FAILED = 2


def import_target(name: str) -> object:
    """Import a module, or a module's attribute when the name ends in one (`vllm.LLM`)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        module, _, attr = name.rpartition(".")
        if not module or exc.name != name:
            raise
        return getattr(importlib.import_module(module), attr)


def preflight(pack: Path, need_gpu: bool) -> str | None:
    """The first reason the imports cannot be meaningful here, as one line; None when there is none.

    Checked in order of cost: the pack folder and the interpreter before importing torch.
    """
    if not (pack / "manifest.json").is_file():
        return f"FAIL pack: no {pack}/manifest.json (build it with `make gpu-pack` and carry {pack}/ along)"
    if sys.version_info[:2] != PYTHON:
        return (f"FAIL python: {sys.version.split()[0]} at {sys.executable}; the pack's wheels are for "
                f"{PYTHON[0]}.{PYTHON[1]}")
    try:
        import torch
    except ImportError as exc:
        return f"FAIL torch: cannot import torch ({exc})"
    if not torch.__version__.startswith(TORCH_SERIES):
        return f"FAIL torch: {torch.__version__}; vLLM's CUDA build needs {TORCH_SERIES}x"
    if need_gpu and not torch.cuda.is_available():
        return "FAIL gpu: torch.cuda.is_available() is False: no CUDA GPU visible"
    return None


def is_missing_driver(exc: BaseException) -> bool:
    """Whether an import failed only because no GPU driver is there (a CUDA library could not load)."""
    text = "".join(traceback.format_exception_only(type(exc), exc))
    return any(marker in text for marker in NO_DRIVER_MARKERS)


def check_imports(modules: tuple[str, ...], need_gpu: bool) -> tuple[list[str], int]:
    """One line per module that does not import, and how many were skipped: without a GPU, a library that cannot
    load for want of a driver is reported on its own line but is no failure.
    """
    lines, skipped = [], 0
    for name in modules:
        try:
            import_target(name)
        except Exception as exc:  # noqa: BLE001 - any import-time error is a finding, reported on its own line
            cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if not need_gpu and is_missing_driver(exc):
                print(f"skip {name}: no GPU driver here ({cause})")
                skipped += 1
                continue
            lines.append(f"FAIL {name}: {cause}")
    return lines, skipped


def kernel_smoke() -> list[str]:
    """Run two of the pack's GPU kernels against plain torch: vLLM's RMSNorm (the custom-op library, with every
    architecture but sm_90 zeroed) and FlashAttention-3. One line per kernel that fails to load, run or agree.
    """
    import torch
    import torch.nn.functional as F

    lines = []
    try:
        from vllm import _custom_ops as ops

        x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
        weight = torch.rand(256, device="cuda", dtype=torch.bfloat16) + 0.5
        out = torch.empty_like(x)
        ops.rms_norm(out, x, weight, 1e-6)
        ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float())
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel is the finding
        lines.append(f"FAIL kernel rms_norm: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        tokens, heads, dim = 32, 4, 128
        q, k, v = (torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
        out = flash_attn_varlen_func(q, k, v, tokens, cu, tokens, cu_seqlens_k=cu, causal=True, fa_version=3)
        ref = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel is the finding
        lines.append(f"FAIL kernel flash-attention-3: {type(exc).__name__}: "
                     f"{str(exc).splitlines()[0] if str(exc) else ''}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m serving.bench.gpu.check",
        description="Check that the GPU pack is installed and that vLLM's offline engine and the engine benchmark "
                    "import: one line per failure, exit 2 on any.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--pack", type=Path, default=Path(".gpu-pack"), help="the pack folder carried along")
    parser.add_argument("--no-gpu", action="store_true",
                        help="no CUDA GPU needed, and CUDA libraries that cannot load for want of a driver pass")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    need_gpu = not args.no_gpu
    reason = preflight(args.pack, need_gpu)
    if reason:
        print(reason)
        return FAILED
    failures, skipped = check_imports(IMPORT_CHECK, need_gpu)
    ok = len(IMPORT_CHECK) - len(failures) - skipped
    print(f"imports: {ok} ok, {skipped} skipped (no GPU driver), {len(failures)} failed, of {len(IMPORT_CHECK)}")
    if need_gpu and not failures:
        failures = kernel_smoke()
        print("GPU kernels: " + ("FAILED" if failures else "rms_norm and flash-attention-3 agree with torch"))
    for line in failures:
        print(line)
    return FAILED if failures else 0


if __name__ == "__main__":
    sys.exit(main())
