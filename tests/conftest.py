"""Test set-up: 8 host CPU devices for sharding tests, set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# gcsfs probes a bucket's type over gRPC, which the GCS emulator of test_gcs_workdir.py does
# not serve (each probe waits for its timeout); read when gcsfs is imported, so set here
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# Most of the suite's time is XLA compiling the same small programs (the debug config's
# step, sampler and engine) in test after test and in the runs tests start as processes:
# jax's persistent compilation cache, keyed by the program and the jax/XLA versions and
# flags, compiles each once. The environment reaches the test workers and subprocesses.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# The rest of the compiling is XLA optimizing programs that then run for milliseconds: jax's
# own switch for that case (LLVM at -O0, no expensive passes) took the cold suite from 21.1
# to 15.5 min on 2 cores (compile-heavy files: -35%).
# It changes how fast the tests' programs run, not what they compute; benchmarks/ and runs
# keep full optimization. Inherited by the runs tests start as processes.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_terminal_summary(terminalreporter):
    """One line saying how many tests were skipped for want of torch (the newest end of the
    supported range, Python 3.12, runs without it; helpers_hf.needs_torch)."""
    skipped = terminalreporter.stats.get("skipped", [])
    n = sum(1 for r in skipped if "needs torch" in str(getattr(r, "longrepr", "")))
    if n:
        terminalreporter.write_line(f"{n} tests skipped: torch is not installed (Hugging Face "
                                    "parity and transformers-written folders)")
