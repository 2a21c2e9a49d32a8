"""Shared helpers of the kernel tests (conftest.py sets TRITON_INTERPRET before this is imported)."""
import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# fp16 only on the GPU: the interpreter's fp16 is slow numpy emulation and adds nothing bf16 does not cover
DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if ON_CUDA else [])


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def randn(*shape: int, dtype: torch.dtype = torch.float32, device: str = DEVICE) -> torch.Tensor:
    """Standard normal values with no exact zeros (a zero hides a missed multiply)."""
    x = torch.randn(*shape, dtype=torch.float32, device=device)
    x = torch.where(x == 0, torch.ones_like(x), x)
    return x.to(dtype)


def make_paged_batch(
    seqs: list[tuple[int, int]],  # per sequence: (context length after this step, queries this step)
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype = torch.float32, spare_blocks: int = 3, device: str = DEVICE,
) -> dict:
    """Random queries and caches, and the metadata of one flattened step. Blocks are
    shuffled across sequences; tables are padded with a valid id (the last block)."""
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks)
    max_blocks = max(blocks_per_seq) + 1
    tables = torch.full((len(seqs), max_blocks), num_blocks - 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used:used + n].to(torch.int32)
        used += n
    num_queries = torch.tensor([n for _, n in seqs])
    return dict(
        q=randn(int(num_queries.sum()), num_heads, head_dim, dtype=dtype, device=device),
        k_cache=randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device),
        v_cache=randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor([ctx for ctx, _ in seqs], device=device),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), num_queries.cumsum(0)]).to(device),
        scale=head_dim ** -0.5,
    )
