"""The paged KV cache: the page pool, the free-page stack, and the model's paged cache modes.

Lives here: `PagePool` (every layer's pages of keys and values in one array per side),
`pages_for` / `prompt_pages` (how many pages a sample or a prompt holds), `pop_pages` /
`push_pages` (the free stack), and the two cache modes the engine runs the model's one
forward path with (`qwen.Qwen.forward`): `PagedDecode` (one token per slot) and `PagedChunk`
(a chunk of a prompt after the pages its earlier chunks wrote). Not here: the loop that
schedules slots and prompts (`loop.py`), call shapes (`shapes.py`), the attention over pages
(`models/attention/paged.py`, behind the kernel seam).

Layout [K, L * NP, page, H]: layer l's page p is page l * NP + p, so a layer's decode hands
the whole pool to a paged-attention kernel with its table offset by l * NP (no per-layer
slice copied out); it is the layout of jax's TPU paged-attention kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ba_jax.models import attention as attention_lib
from ba_jax.models.qwen import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagePool:
    """The engine's pages of keys (after RoPE) and values, every layer in one array per side."""

    k: jax.Array  # [K, L * NP, page, H]
    v: jax.Array

    @staticmethod
    def zeros(config: ModelConfig, num_pages: int, page_size: int, dtype) -> PagePool:
        shape = (config.num_kv_heads, config.num_layers * num_pages, page_size, config.head_dim)
        return PagePool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def write(self, page_A, offset_A, k_AKH, v_AKH) -> PagePool:
        """Keys/values of any batch shape A written at pool page `page_A` (ids out of range
        are dropped: not written), slot `offset_A`, in one scatter per side."""
        return PagePool(attention_lib.write_pages(self.k, page_A, offset_A, k_AKH),
                        attention_lib.write_pages(self.v, page_A, offset_A, v_AKH))

    def write_tokens(self, table_BQ, pos_BC, valid_BC, k_LBCKH, v_LBCKH) -> PagePool:
        """Every layer's keys/values of the tokens at positions `pos_BC` (those with
        valid_BC) of the runs whose pages are `table_BQ` (ids < NP, the pages per layer),
        written at those positions, in one scatter per side."""
        L, ps = k_LBCKH.shape[0], self.k.shape[2]
        NP = self.k.shape[1] // L
        page_BC = jnp.take_along_axis(table_BQ, pos_BC // ps, axis=1, mode="clip")
        page_LBC = jnp.where(valid_BC, jnp.arange(L)[:, None, None] * NP + page_BC, L * NP)
        return self.write(page_LBC, jnp.broadcast_to(pos_BC % ps, page_LBC.shape), k_LBCKH,
                          v_LBCKH)


def pages_for(budget: int, page_size: int) -> int:
    """Pages a sample of `budget` tokens may hold: its first page starts with a copy of its
    prompt's partial last page (at most page_size - 1 tokens), then the tokens it decodes
    (every one but its last); a sample of one token decodes none and holds none."""
    budget = int(budget)
    return 0 if budget <= 1 else -(-(page_size - 1 + budget - 1) // page_size)


def prompt_pages(prompt_len: int, page_size: int) -> int:
    """Pages a prompt of the bucket `prompt_len` fills (padding slots included, masked)."""
    return -(-int(prompt_len) // page_size)


def pop_pages(free_Y, top, want_X):
    """Pages for the True entries of `want_X`, off the top of the free stack (NP elsewhere)
    -> (page_X, new top)."""
    NP = free_Y.shape[0]
    rank_X = jnp.cumsum(want_X) - 1
    page_X = jnp.where(want_X, free_Y[jnp.clip(top - 1 - rank_X, 0, NP - 1)], NP)
    return page_X, top - jnp.sum(want_X)


def push_pages(free_Y, top, page_X, give_X):
    """The pages of the True entries of `give_X` back onto the free stack -> (stack, top)."""
    NP = free_Y.shape[0]
    rank_X = jnp.cumsum(give_X) - 1
    free_Y = free_Y.at[jnp.where(give_X, top + rank_X, NP)].set(page_X, mode="drop")
    return free_Y, top + jnp.sum(give_X)


def _layer_pages(num_layers: int, num_pages: int):
    """Each layer's page-id offset in the pool, [L]."""
    return jnp.arange(num_layers) * num_pages


@dataclasses.dataclass(frozen=True)
class PagedDecode:
    """Cache mode of one decode step (a [B, 1] token per slot) over the pool: row b's
    key/value go to its page `write_page_B[b]` (a page id < NP, the pages per layer; NP: not
    written) at `write_offset_B[b]`, and the token attends to the first `lengths_B[b]` tokens
    of its pages `table_BX[b]` read in order (its prompt's full pages, then its own), itself
    the last. `finish` returns the written pool.

    How the pool is updated is the kernel seam's (`attention.paged_decode`): a kernel that
    reads the new key from the pool gets each layer's key written before it attends (the
    pool carried through the layer scan); the gather path reads the pool in the scan and
    every layer's keys are written in one scatter after it (one pool update per step)."""

    pool: PagePool
    table_BX: jax.Array
    lengths_B: jax.Array
    write_page_B: jax.Array
    write_offset_B: jax.Array
    impl: str  # `attention.paged_impl`'s choice
    interpret: bool = False
    remat = False

    def _num_pages(self, num_layers: int) -> int:
        return self.pool.k.shape[1] // num_layers

    def _write_pages_LB(self, num_layers: int):
        NP = self._num_pages(num_layers)
        # layer l's pages are l * NP + p; rows that do not write get an id past the pool
        return jnp.where(self.write_page_B < NP,
                         _layer_pages(num_layers, NP)[:, None] + self.write_page_B,
                         num_layers * NP)

    def layer_xs(self, num_layers: int):
        return (_layer_pages(num_layers, self._num_pages(num_layers)),
                self._write_pages_LB(num_layers))

    def init(self):
        return self.pool if attention_lib.paged_writes_first(self.impl) else None

    def attend(self, q_B1NH, k_B1KH, v_B1KH, xs_l, state):
        offset, write_page_B = xs_l
        pool = self.pool if state is None else state
        table_BX = self.table_BX + offset
        o_BNH, pools, pending = attention_lib.paged_decode(
            q_B1NH[:, 0], k_B1KH[:, 0], v_B1KH[:, 0], pool.k, pool.v, table_BX, self.lengths_B,
            write_page_B, self.write_offset_B, impl=self.impl, interpret=self.interpret)
        return o_BNH[:, None], None if pools is None else PagePool(*pools), pending

    def finish(self, state, ys):
        if state is not None:  # written layer by layer
            return state
        k_LBKH, v_LBKH = ys
        L = k_LBKH.shape[0]
        page_LB = self._write_pages_LB(L)
        return self.pool.write(page_LB, jnp.broadcast_to(self.write_offset_B, page_LB.shape),
                               k_LBKH, v_LBKH)


def decode_cache(pool: PagePool, table_BX, lengths_B, write_page_B, write_offset_B, *,
                 config: ModelConfig, dtype) -> PagedDecode:
    """The decode cache mode for a model of `config` computing in `dtype`, its kernel chosen by
    the seam (`attention.paged_impl`); table entries past the pool read page 0 (never
    attended: past every length)."""
    NP = pool.k.shape[1] // config.num_layers
    impl = attention_lib.paged_impl(config.attention, dtype=dtype, head_dim=config.head_dim,
                                    page_size=pool.k.shape[2])
    return PagedDecode(pool, jnp.where(table_BX < NP, table_BX, 0), lengths_B, write_page_B,
                       write_offset_B, impl, config.kernel_interpret)


@dataclasses.dataclass(frozen=True)
class PagedChunk:
    """Cache mode of chunked prefill: row b's chunk holds its tokens start_B[b],
    start_B[b] + 1, ... (those with valid_BC, a prefix of the chunk), after its first
    start_B[b] tokens cached in its pages `table_BQ[b]` (ids < NP) read in order. The pool is
    read in the layer scan (`attention.paged_chunk_attention`, a gather: any backend) and the
    chunk's keys/values are written once after it; `finish` returns the written pool.
    Prefilling a sequence chunk by chunk gives the keys and last logits of one full forward."""

    pool: PagePool
    table_BQ: jax.Array
    start_B: jax.Array
    valid_BC: jax.Array
    remat = False

    def layer_xs(self, num_layers: int):
        return _layer_pages(num_layers, self.pool.k.shape[1] // num_layers)

    def init(self):
        return None

    def attend(self, q_BCNH, k_BCKH, v_BCKH, offset, state):
        o_BCNH = attention_lib.paged_chunk_attention(
            q_BCNH, k_BCKH, v_BCKH, self.pool.k, self.pool.v, self.table_BQ + offset,
            self.start_B, self.valid_BC)
        return o_BCNH, None, (k_BCKH, v_BCKH)

    def finish(self, state, ys):
        C = self.valid_BC.shape[1]
        pos_BC = self.start_B[:, None] + jnp.arange(C)[None]
        return self.pool.write_tokens(self.table_BQ, pos_BC, self.valid_BC, *ys)


def chunk_cache(pool: PagePool, table_BQ, start_B, valid_BC, *, num_layers: int) -> PagedChunk:
    """The chunked-prefill cache mode; table entries past the pool read page 0."""
    NP = pool.k.shape[1] // num_layers
    return PagedChunk(pool, jnp.where(table_BQ < NP, table_BQ, 0), start_B,
                      valid_BC.astype(bool))
