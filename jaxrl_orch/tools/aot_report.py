"""What ``python -m jaxrl_orch.tools.aot`` reports: chip figures, analytic costs, the fit verdict.

Owns the published per-chip figures of the TPUs the tool compiles for (``CHIPS``), the analytic
FLOP / byte model of each program (``model_costs``: XLA's cost analysis counts a loop body
once, so it under-counts ``lax.scan`` / ``while`` programs), and the report: per program the
per-chip memory from ``memory_analysis()`` against HBM, FLOPs and bytes (XLA's and the model's;
the estimate takes the larger of each), a roofline time ``max(flops / peak, bytes / HBM
bandwidth)``, and for decoding the tokens/s per chip this implies and its fraction of the
HBM-bandwidth roofline (every weight and every cache entry read once per step).

Pure functions of numbers; nothing here compiles or touches devices.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jaxrl_orch.inference.limits import EngineLimits

if TYPE_CHECKING:  # annotations only: this module imports no JAX
    from jaxrl_orch.config.train import TrainConfig
    from jaxrl_orch.models.configs import ModelConfig


@dataclasses.dataclass(frozen=True)
class Chip:
    peak_flops: float  # bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: int
    ici_bandwidth: float  # one direction, bytes/s per chip (half the published bidirectional)
    source: str


# Google's published figures (docs.cloud.google.com/tpu/docs/v5e, /v6e): v5e 197 TFLOP/s bf16,
# 16 GB HBM2 at 819 GB/s, 400 GB/s ICI; v6e 918 TFLOP/s, 32 GB at 1638 GB/s, 800 GB/s ICI.
# HBM sizes in decimal GB, as published: a fit against them is conservative (the runtime's
# bytes_limit is about 15.75 GiB = 16.9e9 on v5e).
CHIPS: dict[str, Chip] = {
    "v5e": Chip(197e12, 819e9, 16 * 10**9, 200e9, "docs.cloud.google.com/tpu/docs/v5e"),
    "v6e": Chip(918e12, 1638e9, 32 * 10**9, 400e9, "docs.cloud.google.com/tpu/docs/v6e"),
}


def _itemsize(dtype: Any) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def model_costs(
    model_cfg: ModelConfig, cfg: TrainConfig, rows: int, limits: EngineLimits
) -> dict[str, dict[str, float]]:
    """Total (all-chip) FLOPs and HBM bytes per program from the model's shapes: the train step
    from ``cfg``'s training settings on ``rows`` rows, prefill and decoding from the engine's
    ``limits`` (a prefill of the longest prompt, every slot decoding a full cache).

    Matmul FLOPs are 2 per weight per token (the LM head included: a tied embedding is a matmul
    at the head, a gather at the input); causal attention adds ``2 H D T^2`` per row and layer.
    A train step is 3 passes per epoch (forward, backward = 2), +1 forward with remat, +1 for
    recomputed old log-probs, +1 for the KL reference; its bytes are AdamW's (params, grads, two
    moments read, params and moments written) plus one weight read per pass. Decoding reads
    every weight and the whole cache each step (a worst case: length-aware attention reads only
    up to the longest live sequence).
    """
    c = model_cfg
    d = c.d_model
    v = c.vocab_size
    nl = c.n_layers
    n_total = c.num_params
    n_mat = n_total - v * d + d * v  # the embedding's rows count once, as the head's matmul
    hd = c.n_heads * c.head_dim
    kv_row = nl * 2 * c.n_kv_heads * c.head_dim  # cache entries per position
    pbytes = _itemsize(c.dtype)
    mbytes = _itemsize(c.param_dtype)
    t = cfg.trainer.row_len
    tokens = rows * t
    fwd = 2 * n_mat * tokens + 2 * hd * t * t * rows * nl
    passes = cfg.rl.ppo_epochs * (3 + (c.remat != "none"))
    passes += int(bool(cfg.rl.recompute_old_logprobs)) + int(cfg.rl.loss.kl_beta > 0)
    train = {
        "flops": fwd * passes,
        "bytes": n_total * (mbytes * 7 + pbytes * passes),
    }
    lp = limits.max_prefill_length
    prefill = {
        "flops": 2 * n_mat * lp + 2 * hd * lp * lp * nl,
        "bytes": n_total * pbytes + lp * kv_row * pbytes,
    }
    s = limits.max_target_length
    k = limits.steps_per_call
    slots = limits.max_concurrent_decodes
    decode = {
        "flops": k * (2 * n_mat * slots + 4 * hd * s * slots * nl),
        "bytes": k * (n_total * pbytes + slots * s * kv_row * pbytes),
        "min_bytes_per_step": n_total * pbytes + slots * s * kv_row * pbytes,
    }
    reshard = {"flops": float(n_total), "bytes": n_total * (mbytes + pbytes)}
    return {"train_step": train, "prefill": prefill, "decode_step": decode, "reshard": reshard}


def _memory(compiled: Any) -> dict[str, int]:
    ma = compiled.memory_analysis()
    out = {
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes),
        "code_bytes": int(ma.generated_code_size_in_bytes),
    }
    # Donated arguments alias their outputs: counted once.
    out["bytes_per_chip"] = (
        out["argument_bytes"]
        + out["output_bytes"]
        - out["alias_bytes"]
        + out["temp_bytes"]
        + out["code_bytes"]
    )
    return out


def _xla_costs(compiled: Any) -> tuple[float, float]:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list | tuple) else ca
    return float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0))


def build_report(
    topology: str, chip_name: str, programs: list[Any], info: dict[str, Any], max_fraction: float
) -> dict[str, Any]:
    """The ``--json`` object (see ``aot`` for the contract of its top-level keys)."""
    chip = CHIPS[chip_name]
    limit = max_fraction * chip.hbm_bytes
    report: dict[str, Any] = {
        "topology": topology,
        "chip": chip_name,
        "hbm_bytes_per_chip": chip.hbm_bytes,
        "max_fraction": max_fraction,
        "peak_flops_per_chip": chip.peak_flops,
        "hbm_bandwidth_per_chip": chip.hbm_bandwidth,
        "chip_figures_from": chip.source,
        "programs": {},
        "shortfalls": [],
        **info,
    }
    for p in programs:
        if p.refused is not None:
            need, usable = p.refused
            report["programs"][p.name] = {"chips": p.chips, "refused_bytes": need}
            report["shortfalls"].append(
                f"{p.name} needs {need / 2**30:.2f} GiB of temporaries alone, "
                f"{(need - usable) / 2**30:.2f} GiB over the {usable / 2**30:.2f} GiB of the "
                f"{chip_name}'s HBM that XLA compiles for (it refused to compile it)"
            )
            continue
        mem = _memory(p.compiled)
        if p.resident:
            mem["resident_bytes"] = p.resident
            mem["bytes_per_chip"] += p.resident
        xf, xb = _xla_costs(p.compiled)
        mf = p.model["flops"] / p.chips
        mb = p.model["bytes"] / p.chips
        flops = max(xf, mf)
        nbytes = max(xb, mb)
        est = max(flops / chip.peak_flops, nbytes / chip.hbm_bandwidth)
        entry = {
            **mem,
            "chips": p.chips,
            "hbm_fraction": mem["bytes_per_chip"] / chip.hbm_bytes,
            "xla_flops": xf,
            "xla_bytes_accessed": xb,
            "model_flops": mf,
            "model_bytes": mb,
            "flops": flops,
            "bytes_accessed": nbytes,
            "bound": "compute"
            if flops / chip.peak_flops >= nbytes / chip.hbm_bandwidth
            else "memory",
            "est_seconds": est,
        }
        if p.name in ("reshard", "lora_merge"):  # what crosses to the engine
            per_dest = info["transfer_bytes"] / max(1, info["decode_mesh_size"])
            entry["transfer_seconds"] = per_dest / chip.ici_bandwidth
            entry["est_seconds"] = est + entry["transfer_seconds"]
        report["programs"][p.name] = entry
        if mem["bytes_per_chip"] > limit:
            report["shortfalls"].append(
                f"{p.name} needs {mem['bytes_per_chip'] / 1e9:.2f} GB per chip, "
                f"{(mem['bytes_per_chip'] - limit) / 1e9:.2f} GB over {max_fraction:.0%} of "
                f"the {chip_name}'s {chip.hbm_bytes / 1e9:.0f} GB HBM"
            )
    report["fits"] = not report["shortfalls"]
    dec = report["programs"].get("decode_step")
    if dec is not None:
        k = info["steps_per_call"]
        slots = info["decode_slots"]
        n = dec["chips"]
        step_s = dec["est_seconds"] / k
        min_bytes = next(p.model["min_bytes_per_step"] for p in programs if p.name == "decode_step")
        roofline_s = min_bytes / n / chip.hbm_bandwidth
        report["decode"] = {
            "step_seconds": step_s,
            "tokens_per_s_per_chip": slots / step_s / n,
            "hbm_roofline_tokens_per_s_per_chip": slots / roofline_s / n,
            "fraction_of_hbm_roofline": roofline_s / step_s,
        }
    return report


def format_text(r: dict[str, Any]) -> str:
    gb = lambda b: f"{b / 1e9:7.2f}"
    lines = [
        f"{r['model']} on {r['topology']} ({r['chip']}: {r['hbm_bytes_per_chip'] / 1e9:.0f} GB "
        f"HBM, {r['peak_flops_per_chip'] / 1e12:.0f} TFLOP/s bf16, "
        f"{r['hbm_bandwidth_per_chip'] / 1e9:.0f} GB/s; {r['chip_figures_from']})",
        f"trainer mesh {r['trainer_mesh']}, decode mesh {r['decode_mesh']}; train rows "
        f"{r['train_rows']} x {r['row_len']}, {r['decode_slots']} decode slots",
        "program       chips    args   outs   temps  total GB  of HBM   TFLOPs   GB accessed"
        "  est s",
    ]
    for name, p in r["programs"].items():
        if "refused_bytes" in p:
            lines.append(f"{name:<12} {p['chips']:>5}  refused by XLA: out of HBM")
            continue
        lines.append(
            f"{name:<12} {p['chips']:>5} {gb(p['argument_bytes'])}{gb(p['output_bytes'])}"
            f"{gb(p['temp_bytes'])} {gb(p['bytes_per_chip'])}   {p['hbm_fraction']:6.1%}"
            f"  {p['flops'] / 1e12:7.3f}  {p['bytes_accessed'] / 1e9:10.3f}  "
            f"{p['est_seconds']:.4f} ({p['bound']})"
            + (
                f"; total holds {gb(p['resident_bytes'])} GB resident"
                if "resident_bytes" in p
                else ""
            )
        )
    if "transfer_bytes" in r:
        what = "LoRA adapters" if r.get("lora") else "every weight, in the engine's dtype"
        lines.append(f"moved per version: {r['transfer_bytes'] / 1e6:.1f} MB ({what})")
    if "decode" in r:
        d = r["decode"]
        lines.append(
            f"decode: {d['step_seconds'] * 1e3:.2f} ms/step, {d['tokens_per_s_per_chip']:.0f} "
            f"tokens/s per chip ({d['fraction_of_hbm_roofline']:.0%} of the HBM-bandwidth "
            f"roofline {d['hbm_roofline_tokens_per_s_per_chip']:.0f})"
        )
    if "compile_s" in r:
        lines.append(f"compiled in {r['compile_s']:.1f} s")
    lines.append("fits" if r["fits"] else "DOES NOT FIT: " + "; ".join(r["shortfalls"]))
    return "\n".join(lines)
