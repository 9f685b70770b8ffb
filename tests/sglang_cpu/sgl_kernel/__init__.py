"""Test-only stand-in for the two `sgl_kernel` CPU functions SGLang's CPU mode imports.

SGLang (0.5.23) runs on a CPU with `--device cpu`, but two of its CPU code paths import compiled
functions from `sgl_kernel` (the `sglang-kernel` package), and the registry has no CPU build of
it: `assign_req_to_token_pool_cpu` (sglang/srt/mem_cache/allocation.py, on every KV-cache
allocation) and `copy_all_layer_kv_cache_cpu` (sglang/kernels/ops/kvcache/cache_move.py). This
module gives both in plain torch, with the semantics of the Triton kernels beside which SGLang
calls them. Everything else is the real, unmodified SGLang server.

Only the SGLang test servers see it (`rollout.sglang.env: {PYTHONPATH: tests/sglang_cpu}`); nothing
outside tests/ imports it, and a GPU server uses the real `sgl_kernel`.
"""

import ctypes

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For request k: req_to_token[req_pool_indices[k], start[k]:end[k]] = the next end[k]-start[k]
    entries of out_cache_loc (requests take consecutive slices of it, in order)."""
    del pool_len  # the row length; req_to_token's own shape says it
    offset = 0
    for k in range(req_pool_indices.numel()):
        start, end = int(start_offset[k]), int(end_offset[k])
        n = end - start
        if n > 0:
            row = int(req_pool_indices[k])
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every KV buffer b (base address data_ptrs[b], strides[b] bytes a row): copy row src_loc[i]
    to row tgt_loc[i]. All source rows are read before any is written (safe in place)."""
    src, tgt = src_loc.tolist(), tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * stride, row, stride)


def __getattr__(name: str):
    # SGLang's CPU mode imports more `*_cpu` kernels at module level (speculative decoding trees,
    # MoE, quantised GEMMs) than a dense model ever calls; those names resolve to a function that
    # fails loudly, so a code path that really needs a compiled kernel stops instead of computing
    # something wrong.
    if name.endswith("_cpu"):
        def missing(*args, **kwargs):
            raise NotImplementedError(f"sgl_kernel.{name} is not in posttrain's test stand-in "
                                      "(tests/sglang_cpu): this SGLang code path needs the compiled kernel")
        missing.__name__ = name
        return missing
    raise AttributeError(f"module 'sgl_kernel' (posttrain's test stand-in) has no attribute {name!r}")
