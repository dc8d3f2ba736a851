"""Can qwix's LoRA adapt this model as the trainer runs it? (why models/lora.py is our own)

    pip install qwix==0.1.8 && python benchmarks/qwix_lora_probe.py

For the tiny-byte model, unrolled and with ``scan_layers`` (what every TPU config uses): apply
``qwix.apply_lora_to_model`` (rank 4 on every dot), count the ``nnx.LoRAParam`` arrays it adds,
then take the gradient of a loss with respect to them the way ``trainer/step.py`` does
(``nnx.split`` into adapters and the rest, ``nnx.merge`` inside ``jax.grad``). Prints one line
per case: what qwix added, and whether the gradient could be taken.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from jaxrl_orch.models.transformer import Transformer, get_config


def probe(scan_layers: bool) -> str:
    cfg = dataclasses.replace(get_config("tiny-byte"), scan_layers=scan_layers)
    tokens, pos = jnp.ones((1, 8), jnp.int32), jnp.arange(8)[None]
    provider = qwix.LoraProvider(module_path=".*", rank=4, alpha=8.0)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    try:
        model = qwix.apply_lora_to_model(model, provider, tokens, pos, rngs=nnx.Rngs(1))
    except Exception as exc:  # noqa: BLE001 - the finding is the failure itself
        return f"apply_lora_to_model failed: {type(exc).__name__}"
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    found = f"added {len(jax.tree.leaves(adapters))} LoRA arrays"
    loss = lambda a: jnp.sum(nnx.merge(graphdef, a, rest)(tokens, pos) ** 2)
    try:
        grads = jax.grad(loss)(adapters)
    except Exception as exc:  # noqa: BLE001
        return f"{found}; the trainer's gradient failed: {type(exc).__name__}"
    nonzero = sum(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))
    return f"{found}; gradient taken, {nonzero} non-zero"


def main() -> None:
    for scan in (False, True):
        print(f"scan_layers={scan}: {probe(scan)}")


if __name__ == "__main__":
    main()
