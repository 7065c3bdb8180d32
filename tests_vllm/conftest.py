"""Set-up of the vLLM rollout tests (`make test-vllm`): the main suite's JAX settings (8 host
CPU devices, set before jax is imported), its helpers on the path (tests/helpers_hf.py,
tests/test_sampler.py), and one float32 engine per architecture shared by a module.

Not collected by `make test` (pyproject's testpaths is tests/); these need `.venv-vllm`.
"""

import dataclasses
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "tests"))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def engines():
    """get(arch, model) -> a float32 eager-mode VllmEngine (no torch.compile: a short start)
    for that model's config, started on first use and closed when the module ends. Tests
    sync the weights they need first."""
    from ba_jax.vllm_rollout import VllmEngine
    from helpers_vllm import MAX_MODEL_LEN

    started: dict[str, VllmEngine] = {}

    def get(arch: str, model) -> VllmEngine:
        if arch not in started:
            # every token an EOS of the config: rows stopping only at the eos_ids asked for
            # show that the engine ignores the config's (and generation config's) EOS
            config = dataclasses.replace(model.config,
                                         eos_token_id=tuple(range(model.config.vocab_size)))
            started[arch] = VllmEngine(config, dtype="float32", max_model_len=MAX_MODEL_LEN,
                                       max_num_seqs=32, enforce_eager=True)
        return started[arch]

    yield get
    for eng in started.values():
        eng.close()
