"""The compiled train step's memory with LoRA, QLoRA and every weight, small-byte and 8B shapes.

    python benchmarks/lora_memory.py --json

One run, deviceless on the v5e-8 topology of ``configs/tpu_v5e_8_lora.gin`` (needs the tpu
extra): the trainer's RL step on its 4 chips (fsdp 2 x tp 2), compiled from that config with
``Model.name`` set to each model, ``Lora.rank`` 16 over a bf16 base, 16 over an int8 and an
int4 base (QLoRA, ``Lora.quantize``), or 0 (every weight). Per chip, from XLA's
``memory_analysis()``: arguments (params, optimizer state, batch, and a LoRA step's frozen
base), temporaries, and the total with donated buffers counted once. A step XLA refuses to
compile for lack of HBM is reported as the temporaries it said it needed (a lower bound on its
total). ``docs/lora.md`` quotes the result.
"""

from __future__ import annotations

import argparse
import json

from jaxrl_orch.compose.model import model_config
from jaxrl_orch.compose.placement import build_placement
from jaxrl_orch.compose.precision import accel_model_config
from jaxrl_orch.compose.trainers import rl_model
from jaxrl_orch.config.load import load_config
from jaxrl_orch.models.tokenizer import load_tokenizer
from jaxrl_orch.tools import aot, aot_report

CONFIG = "configs/tpu_v5e_8_lora.gin"


def measure(model: str, rank: int, quantize: str = "none") -> dict[str, float | str]:
    held = None if quantize == "none" else quantize  # the table's "none": a base as loaded
    params = [f"Model.name = '{model}'", f"Lora.rank = {rank}", f"Lora.quantize = {held!r}"]
    cfg = load_config([CONFIG], params)
    _, devices = aot.topology_devices(cfg.processes.tpu_topology)
    trainer_mesh = build_placement(cfg, len(devices), devices=devices).trainer_mesh
    base = model_config(model, load_tokenizer(cfg.model.tokenizer))
    model_cfg = accel_model_config(base, cfg, "tpu")
    compiled, _, _ = aot.compile_train_step(cfg, rl_model(cfg, model_cfg), trainer_mesh)
    row: dict[str, float | str] = {"model": model, "lora_rank": rank, "base": quantize}
    if isinstance(compiled, tuple):
        row["refused_temporaries_gb"] = compiled[0] / 1e9
        return row
    mem = aot_report._memory(compiled)
    row.update(
        {
            "argument_gb": mem["argument_bytes"] / 1e9,
            "temp_gb": mem["temp_bytes"] / 1e9,
            "total_gb_per_chip": mem["bytes_per_chip"] / 1e9,
        }
    )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["small-byte", "llama-3.1-8b"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    for model in args.models:
        for rank, quantize in (
            (args.rank, "none"),
            (args.rank, "int8"),
            (args.rank, "int4"),
            (0, "none"),
        ):
            row = measure(model, rank, quantize)
            print(json.dumps(row) if args.json else row, flush=True)


if __name__ == "__main__":
    main()
