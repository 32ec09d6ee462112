"""The GPU's kernels, in Triton: paged attention over the block tables (decode and prefill), the RoPE + KV store,
add + RMSNorm and SiLU-and-mul. Each wrapper takes plain tensors and launches one kernel (two for split-KV decode).

On a CUDA device they compile for it; on the CPU they run only under Triton's interpreter (TRITON_INTERPRET=1, set
before this package is imported), which is how the tests check them without a GPU.
"""
