"""TEST INFRASTRUCTURE: a stand-in for `sgl_kernel`, for running a real SGLang server on a CPU-only machine.

Never install this package and never put it on the project's path: the server launcher in
tests/sglang_cpu/server.py puts its parent folder first on the PYTHONPATH of the SGLang server
process only, where it shadows the real `sgl_kernel`.

Why it exists. SGLang imports `sgl_kernel` unconditionally. PyPI's `sglang-kernel` wheels are CUDA
builds (importing one on a machine without libcuda fails) and there is no source release to build
its CPU variant from. With SGLANG_USE_CPU_ENGINE=1 on a CPU without AMX tiles, SGLang runs its
torch-native code (torch_native attention, pytorch sampling, sdpa vision attention) and calls no
kernel at all; it only needs the names to exist while its modules import.

What it provides, for sglang 0.5.23, and nothing else:
- `IMPORTED`: names that SGLang modules on the CPU serving path import from `sgl_kernel` (and its
  submodules) at import time.
- `TORCH_OPS`: names that SGLang modules read from `torch.ops.sgl_kernel` at import time when
  SGLANG_USE_CPU_ENGINE=1 (sglang.srt.models.qwen3_5, which the Qwen-VL multimodal processor
  imports: without them SGLang finds no processor for Qwen2_5_VLForConditionalGeneration).
Each is a placeholder that raises NotImplementedError naming itself if it is ever called.

What it must NOT provide:
- `torch.ops.sgl_kernel.convert_weight_packed`: SGLang takes its presence as "the Intel AMX kernels
  are available" and would then call the kernels on a CPU with AMX tiles.
- Names SGLang probes with `hasattr(torch.ops.sgl_kernel, ...)` (`fused_qk_norm_cpu`,
  `fused_qk_norm_rope_cpu`, ...) or imports inside `try: ... except ImportError` (`scalar_type`,
  `flash_attn`, `kvcacheio`, ...): their absence is what selects SGLang's fallbacks.
SGLang loads every model module it ships and logs "Ignore import error" for those that need more
names (grok, mamba, qwen3_next, ...): those models cannot be served here; Qwen2, Qwen2.5-VL and Qwen3
can. Any other name raises ImportError / AttributeError as a missing name normally does, so a newer
SGLang that needs more names fails at import, naming the missing one.
"""

from __future__ import annotations

import sys
import types

import torch

# submodule ("" for the package) -> names imported from it at import time
IMPORTED: dict[str, tuple[str, ...]] = {
    "": (
        # KV-cache moves and slot assignment of speculative decoding (sglang.kernels.ops.kvcache,
        # sglang.kernels.ops.speculative, sglang.srt.mem_cache.allocation): never run without it.
        "copy_all_layer_kv_cache_cpu",
        "assign_req_to_token_pool_cpu",
        "assign_draft_cache_locs_contiguous_cpu",
        "assign_extend_cache_locs_cpu",
        "build_tree_kernel_efficient_cpu",
        "fill_accept_out_cache_loc_cpu",
        "fill_bonus_tokens_cpu",
        "verify_tree_greedy_cpu",
    ),
}
TORCH_OPS: tuple[str, ...] = (
    "fused_sigmoid_mul_cpu",  # all four: sglang.srt.models.qwen3_5
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)
NOT_PROVIDED = ("convert_weight_packed",)  # see the docstring


def placeholder(qualname: str):
    """A callable standing for the kernel `qualname` that raises if it is ever called."""

    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"{qualname} was called, but sgl_kernel here is the CPU test stand-in "
            "(tests/sglang_cpu/standin): no kernel exists. SGLang left its torch-native path; "
            "check SGLANG_USE_CPU_ENGINE=1, --device cpu and the attention/sampling backends."
        )

    kernel.__name__ = kernel.__qualname__ = qualname.rsplit(".", 1)[-1]
    kernel.is_sgl_kernel_placeholder = True
    return kernel


def _install() -> None:
    package = sys.modules[__name__]
    for submodule, names in IMPORTED.items():
        module = package
        if submodule:
            module = types.ModuleType(f"{__name__}.{submodule}", f"Stand-in for {__name__}.{submodule}.")
            sys.modules[module.__name__] = module
            setattr(package, submodule, module)
        for name in names:
            setattr(module, name, placeholder(f"{module.__name__}.{name}"))
    namespace = torch.ops.sgl_kernel  # torch caches the namespace object, so attributes set on it stay
    for name in TORCH_OPS:
        if not hasattr(namespace, name):  # a real op registered by someone else wins
            setattr(namespace, name, placeholder(f"torch.ops.sgl_kernel.{name}"))


__version__ = "0.0.0+cpu-test-standin"
_install()
