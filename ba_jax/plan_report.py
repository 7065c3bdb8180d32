"""The planner's reports: `plan` and `compiled_memory` results as text (`python -m ba_jax.plan`).

Not here: computing them (`plan.py`), the analytic model (`plan_model.py`).
"""

from __future__ import annotations

from ba_jax.plan_model import DEVICES, GIB


def format_plan(p: dict, device: str | None = None) -> str:
    """Human-readable report of `plan(...)`; `device` restricts the verdict to one name."""
    g = lambda n: f"{n / GIB:9.2f} GiB"
    b, m = p["bytes"], p["mesh"]
    lines = [
        f"model: {p['param_count']:,} parameters ({p['param_dtype']} storage, "
        f"{p['compute_dtype']} compute), remat {'on' if p['use_remat'] else 'off'}",
        f"mesh: {p['num_devices']} devices = data {m['data']} x fsdp {m['fsdp']} x tensor "
        f"{m['tensor']}",
        (f"batch: {p['rows']} rows per optimizer step, packed: one row of "
         f"{p['max_tokens_per_device']} tokens per device per block, up to "
         f"{p['blocks_per_minibatch']} blocks per mini-batch"
         if p["max_tokens_per_device"] else
         f"batch: {p['rows']} rows per optimizer step, {p['microbatch_rows_per_device']} per "
         f"device per micro-batch, sequence {p['seq_len']} (prompt bucket {p['prompt_bucket']})"),
        "per device:",
        f"  parameters              {g(b['params'])}",
        f"  gradients               {g(b['grads'])}",
        f"  grad accumulator (f32)  {g(b['grad_accumulator'])}",
        f"  optimizer state         {g(b['optimizer'])}",
        f"  update batch            {g(b['batch'])}" + (
            "   (mini-batches, blocks, indices)" if p["max_tokens_per_device"] else ""),
        f"  activations, remat      {g(b['activations_remat'])}   (estimate)",
        f"  activations, no remat   {g(b['activations_no_remat'])}   (estimate)",
        f"    of which logits       {g(b['logits'])}",
        f"    scores of one layer   {g(b['attention_scores_per_layer'])}",
        f"  sampler weights         {g(b['decode_weights'])}   ({p['compute_dtype']} copy, "
        "whole on each row device)",
        f"  sampler KV cache        {g(b['kv_cache'])}" + (
            f"   ({p['shapes']['slots_per_device']} slots, "
            f"{p['shapes']['pages_per_device']} pages per device)"
            if "slots_per_device" in p["shapes"] else "   (static sampler)"),
        f"  sampler transient       {g(b['sampler_transient'])}   (estimate)",
        f"  peak, train step        {g(b['train_peak'])}" + (
            f"   (optimizer step alone {g(b['train_apply']).strip()})"
            if p["max_tokens_per_device"] else ""),
        f"  peak, sampling          {g(b['sample_peak'])}",
        f"  peak                    {g(b['peak'])}",
    ]
    if p["slots_that_fit"]:
        fit = p["slots_that_fit"]
        lines.append("largest rollout.num_slots whose sampling peak fits (per call, kv_pages=0): "
                     + ", ".join(f"{n} {fit[n]}" for n in ([device] if device else fit)))
    lines += [f"warning: {w}" for w in p["warnings"]]
    names = [device] if device else list(DEVICES)
    lines.append(f"fit (peak <= {p['usable_fraction']:.0%} of HBM):")
    for name in names:
        cap = DEVICES[name] * GIB
        verdict = "fits" if p["fits"][name] else "does NOT fit"
        lines.append(f"  {name:9s} {DEVICES[name]:5.0f} GiB  {verdict:12s} "
                     f"({b['peak'] / cap:6.1%} of HBM)")
    return "\n".join(lines) + "\n"


def format_compiled(out: dict, num_devices: int, platform: str) -> str:
    """Human-readable report of `compiled_memory(...)` compiled on `platform` devices."""
    g = lambda n: f"{n / GIB:8.2f} GiB"
    lines = [f"compiled on {num_devices} {platform} devices, per device:"]
    for name, m in out.items():
        lines.append(f"  {name:6s} argument {g(m['argument_bytes'])}  output {g(m['output_bytes'])}"
                     f" (aliased {g(m['alias_bytes'])})  temp {g(m['temp_bytes'])}")
        lines.append(f"         peak     {g(m['peak_bytes'])}  planned {g(m['planned_bytes'])}"
                     f"  planned / compiled {m['planned_bytes'] / max(m['peak_bytes'], 1):.2f}")
        if "acc_peak_bytes" in m:  # packed: the two programs and what sits beside them
            lines.append(f"         packed: block program {g(m['acc_peak_bytes'])} + beside it "
                         f"{g(m['resident_bytes'])}; optimizer step {g(m['apply_peak_bytes'])}"
                         f" + held data {g(m['held_bytes'])}")
    return "\n".join(lines) + "\n"
