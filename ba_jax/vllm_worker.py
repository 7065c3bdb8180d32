"""The vLLM engine process of the vLLM rollout backend; `ba_jax.vllm_rollout` starts it.

Lives here: the process's main loop (`main`), the one `vllm.LLM` it holds (`_Engine`: build,
weight reload, generation) and the framing both ends speak (`send_frame` / `recv_frame`).
Not here: anything of the trainer (JAX, the key table, the Rollout): see `vllm_rollout.py`.

Runs as a plain script under `.venv-vllm/bin/python` (`make vllm`), whose transformers is
the one vLLM needs, not the trainer's: so this file imports only the standard library and
numpy at module level, and torch/vllm inside `_Engine`. The client imports it for the
framing only.

    .venv-vllm/bin/python ba_jax/vllm_worker.py FD PARENT_PID

FD is this end of a socketpair; every message is a frame: an 8-byte little-endian length,
a JSON header, then the raw bytes of the arrays the header lists under "arrays" ([name,
numpy dtype string, shape], in order). Requests (header "op"): "init" (answered once the
engine is built), "load_weights" (followed by one byte carrying the weights' memfd with
SCM_RIGHTS when the region is new), "generate", "shutdown". Every answer has "ok"; a failed
request answers {"ok": false, "error": one line, "traceback": ...} and the process carries
on, except for "init".

Lifetime: PR_SET_PDEATHSIG delivers SIGKILL when the parent dies (kill -9 included), and
the process exits when its socket reaches EOF (the parent closed it or died).
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np

_LEN = struct.Struct("<Q")
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# ----------------------------------------------------------------------------- framing


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("socket closed")
        got += k
    return buf


def send_frame(sock: socket.socket, header: dict[str, Any],
               arrays: dict[str, np.ndarray] | None = None) -> None:
    """One message: length, JSON header (with the arrays' names, dtypes and shapes), bytes."""
    arrays = {k: np.ascontiguousarray(a) for k, a in (arrays or {}).items()}
    header = dict(header, arrays=[[k, a.dtype.str, list(a.shape)] for k, a in arrays.items()])
    raw = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    for a in arrays.values():
        if a.size:
            sock.sendall(memoryview(a).cast("B"))


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The next message -> (header, arrays); EOFError when the other end has closed."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    header = json.loads(_recv_exact(sock, n))
    arrays = {}
    for name, dtype, shape in header.pop("arrays", []):
        dt = np.dtype(dtype)
        arrays[name] = np.frombuffer(_recv_exact(sock, math.prod(shape) * dt.itemsize),
                                     dt).reshape(shape)
    return header, arrays


def _error(e: BaseException) -> dict[str, Any]:
    line = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
    return {"ok": False, "error": line, "traceback": traceback.format_exc()}


# ----------------------------------------------------------------------------- the engine


class _Engine:
    """One in-process `vllm.LLM` on dummy weights, reloaded from shared memory."""

    def __init__(self, init: dict[str, Any]):
        # the engine core and the model must live in this process, so that `reload_weights`
        # gets our tensors by reference (no pickling, no second process to outlive us)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch
        import vllm

        self.torch = torch
        self.vllm = vllm
        self.dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[init["dtype"]]
        folder = tempfile.mkdtemp(prefix="ba_jax_vllm_")
        try:  # the folder holds config.json only; vLLM reads it while building the engine
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(init["hf_config"], f)
            self.llm = vllm.LLM(
                folder, dtype=init["dtype"], load_format="dummy", skip_tokenizer_init=True,
                seed=init["seed"], max_model_len=init["max_model_len"],
                max_num_seqs=init["max_num_seqs"], enforce_eager=init["enforce_eager"],
                kv_cache_memory_bytes=init["kv_cache_bytes"],
                distributed_executor_backend="uni", generation_config="vllm",
                logprobs_mode="raw_logprobs", **init.get("llm_kwargs", {}))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        pid = self.llm.apply_model(lambda model: os.getpid())[0]
        if pid != os.getpid():
            raise RuntimeError(f"vLLM runs the model in process {pid}, not in the engine "
                               f"process {os.getpid()}: weights could not be loaded into it")
        self.region: mmap.mmap | None = None

    def load_weights(self, msg: dict[str, Any], fd: int | None) -> dict[str, Any]:
        """Reloads every tensor listed in `msg["tensors"]` ([HF key, shape, byte offset])
        from the shared region, as vLLM's `reload_weights` does for a checkpoint."""
        t0 = time.perf_counter()
        if fd is not None:  # a new region: the old one (if any) is dropped
            self.region = mmap.mmap(fd, msg["size"])
            os.close(fd)
        if self.region is None or len(self.region) != msg["size"]:
            raise RuntimeError("no weight region of the announced size was shared")
        torch, region = self.torch, self.region
        itemsize = torch.empty((), dtype=self.dtype).element_size()

        def tensors():
            for key, shape, offset in msg["tensors"]:
                n = math.prod(shape)
                if offset + n * itemsize > len(region):
                    raise ValueError(f"{key}: bytes [{offset}, {offset + n * itemsize}) lie "
                                     f"outside the {len(region)}-byte region")
                yield key, torch.frombuffer(region, dtype=self.dtype, count=n,
                                            offset=offset).view(shape)

        # layerwise reload: restores each layer's checkpoint-format parameters, loads them
        # with the model's own `load_weights` (q/k/v and gate/up fused there), then redoes
        # the CPU weight packing of each layer
        self.llm.collective_rpc("reload_weights", kwargs=dict(
            weights_iterator=tensors(), is_checkpoint_format=True))
        self.llm.apply_model(_repack_tied_heads)
        # cached prefixes hold keys/values computed with the old weights
        self.llm.reset_prefix_cache()
        return {"ok": True, "seconds": time.perf_counter() - t0}

    def generate(self, msg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """One request per row (prompt p's G rows at [p*G, (p+1)*G)) -> padded arrays."""
        SamplingParams = self.vllm.SamplingParams
        G, pad = msg["num_samples"], msg["pad_id"]
        budgets, seeds = msg["max_tokens"], msg["seeds"]
        B = len(msg["prompts"]) * G
        if len(budgets) != B or len(seeds) != B:
            raise ValueError(f"{len(budgets)} budgets and {len(seeds)} seeds for {B} rows")
        temperature = float(msg["temperature"])
        # ignore_eos (benchmarks): every row runs to its budget; no stop ids either, since
        # vLLM still stops on those
        ignore = bool(msg.get("ignore_eos", False))
        stops = [] if ignore else list(msg["stop_token_ids"])
        requests = [{"prompt_token_ids": list(p)} for p in msg["prompts"] for _ in range(G)]
        params = [SamplingParams(
            temperature=temperature, top_k=int(msg["top_k"]), top_p=float(msg["top_p"]),
            max_tokens=int(budgets[b]), seed=int(seeds[b]) if temperature > 0 else None,
            stop_token_ids=stops, ignore_eos=ignore, logprobs=0,
            detokenize=False, flat_logprobs=True) for b in range(B)]
        t0 = time.perf_counter()
        outs = self.llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        R = max(budgets)
        tokens_BR = np.full((B, R), pad, np.int32)
        logp_BR = np.zeros((B, R), np.float32)
        lengths_B = np.zeros(B, np.int32)
        eos_B = np.zeros(B, np.uint8)
        for b, out in enumerate(outs):
            c = out.outputs[0]
            ids, lps = list(c.token_ids), c.logprobs
            if c.finish_reason not in ("stop", "length") or len(ids) > budgets[b]:
                raise RuntimeError(f"row {b}: finish_reason {c.finish_reason!r} after "
                                   f"{len(ids)} of {budgets[b]} tokens")
            tokens_BR[b, :len(ids)] = ids
            logp_BR[b, :len(ids)] = [lps[t][tok].logprob for t, tok in enumerate(ids)]
            lengths_B[b] = len(ids)
            eos_B[b] = c.finish_reason == "stop"
        return ({"ok": True, "seconds": seconds},
                {"tokens": tokens_BR, "logprobs": logp_BR, "lengths": lengths_B,
                 "eos": eos_B})


def _repack_tied_heads(model) -> int:
    """Redoes the CPU GEMM packing of an output head that shares its weight with the input
    embedding: vLLM's reload never loads such a head (the checkpoint has no lm_head.weight),
    so without this it would keep multiplying by the packed copy of the old weights."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    modules = list(model.modules())
    embeds = {m.weight.data_ptr() for m in modules if type(m) is VocabParallelEmbedding}
    n = 0
    for m in modules:
        if isinstance(m, ParallelLMHead) and m.weight.data_ptr() in embeds:
            m.quant_method.process_weights_after_loading(m)
            n += 1
    return n


# ----------------------------------------------------------------------------- main loop


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies, even by kill -9 (Linux prctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)


def main(argv: list[str]) -> int:
    """Serves one client over the socket at fd argv[1] until shutdown or EOF."""
    fd, parent_pid = int(argv[1]), int(argv[2])
    _die_with_parent(parent_pid)
    sock = socket.socket(fileno=fd)
    try:
        init, _ = recv_frame(sock)
    except EOFError:
        return 0
    t0 = time.perf_counter()
    try:
        engine = _Engine(init)
    except BaseException as e:  # noqa: BLE001 - reported to the client, then exit
        send_frame(sock, _error(e))
        return 1
    send_frame(sock, {"ok": True, "pid": os.getpid(), "seconds": time.perf_counter() - t0,
                      "vllm_version": engine.vllm.__version__})
    while True:
        try:
            msg, _ = recv_frame(sock)
            passed_fd = None
            if msg.get("with_fd"):
                _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                if len(fds) != 1:
                    raise EOFError("the weights' file descriptor did not arrive")
                passed_fd = fds[0]
        except EOFError:
            return 0
        if msg["op"] == "shutdown":
            send_frame(sock, {"ok": True})
            return 0
        arrays: dict[str, np.ndarray] = {}
        try:
            if msg["op"] == "load_weights":
                reply = engine.load_weights(msg, passed_fd)
            elif msg["op"] == "generate":
                reply, arrays = engine.generate(msg)
            else:
                raise ValueError(f"unknown op {msg['op']!r}")
        except Exception as e:  # noqa: BLE001 - the client raises it
            reply, arrays = _error(e), {}
        send_frame(sock, reply, arrays)


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip vLLM's interpreter-exit teardown: nothing of it must outlive us
