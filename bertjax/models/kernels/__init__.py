"""Attention kernels every architecture may select: the einsum reference, flash attention (TPU
Pallas, jax.nn), its dropout variants (TPU and GPU Pallas), and the block-sparse splash kernels."""
