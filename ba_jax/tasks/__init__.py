"""Verifiable tasks that ba_jax generates itself (no download): the embedded default."""
