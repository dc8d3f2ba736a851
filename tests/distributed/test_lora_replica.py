"""A LoRA run's engine replica in another process: the base pulled once, adapters per version.

The replica (``support.replica_main --lora-rank 4``: tiny-byte, tp=2 over its 2 CPU devices) is
loaded by a ``RemotePool``, as in a run: the frozen base once (``part: base``), then only float32
adapters (``part: adapters``), which it merges into the base it holds. The bytes it pulled per
version are measured at the weight offer and compared with a full-weights version's. What it
serves must decode exactly like an in-process engine on the merged weights (``merge_adapters``
here), each token stamped with the adapters' version; the order base-then-adapters is enforced,
and a replica of a run without LoRA refuses both parts by name.
"""

from __future__ import annotations

import asyncio
import queue

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from support.replica_main import lora_adapters
from support.replica_procs import reference_run

from jaxrl_orch.compose.staging import tree_nbytes
from jaxrl_orch.config.runtime import ProcessesSettings as Processes
from jaxrl_orch.distributed.pool import RemotePool
from jaxrl_orch.distributed.replica_client import RemoteEngineClient, WeightPullError
from jaxrl_orch.distributed.source import TransferSource
from jaxrl_orch.distributed.transfer import local_layout
from jaxrl_orch.models.lora import merge_adapters
from jaxrl_orch.types import SamplingParams
from sharding.reshard import reshard

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

PROMPTS = [list(b"the quick brown"), list(b"jax on two cores")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PULL = {"timeout_s": 30.0, "extra_s": 30.0}  # a pull's deadline, and the swap's
DEADLINES = Processes(
    weight_pull_timeout_s=30.0,
    weight_load_extra_s=30.0,
    replica_warmup_s=60.0,
    replica_start_timeout_s=60.0,
)


def _adapters(engine, seed: int):
    """Rank-4 adapters of tiny-byte with B != 0 (so they change the outputs), replicated over
    the engine's mesh, as the trainer group stages them."""
    abstract, scale = lora_adapters(4)
    everywhere = NamedSharding(engine.mesh, PartitionSpec())
    leaves, treedef = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    values = [
        jax.device_put(0.3 * jax.random.normal(k, a.shape, jnp.float32), everywhere)
        for k, a in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, values), scale


def _lines(q: queue.Queue) -> list[str]:
    out = []
    while not q.empty():
        out.append(q.get())
    return out


def test_a_lora_replica_keeps_the_base_and_serves_it_merged_with_each_versions_adapters(
    lora_replica, reference, offer, monkeypatch
):
    url, _, stdout = lora_replica
    engine, params = reference
    base = params[1]
    adapters = {v: _adapters(engine, v)[0] for v in (1, 2)}
    scale = lora_adapters(4)[1]
    merge = jax.jit(lambda b, a: merge_adapters(b, a, scale), out_shardings=engine.param_shardings)
    want = {v: reference_run(engine, merge(base, adapters[v]), v, PROMPTS, GREEDY) for v in (1, 2)}
    staged_base = reshard(base, local_layout(engine.param_shardings))

    # What the replica pulls: every offer is pulled exactly once, so an offer's bytes are what
    # crossed to the replica when the load that named its uuid returned.
    offered: dict[int, int] = {}
    make_offer = offer.offer

    def measured_offer(arrays, **kwargs):
        uuid = make_offer(arrays, **kwargs)
        offered[uuid] = tree_nbytes(arrays)
        return uuid

    monkeypatch.setattr(offer, "offer", measured_offer)

    async def main():
        client = RemoteEngineClient(url, replica=1, timeout_s=60.0)
        with pytest.raises(WeightPullError, match=r"part 'adapters' before any part 'base'"):
            await client.load_weights(1, offer.offer(adapters[1]), **PULL, part="adapters")
        # From here the pool decides what the replica pulls, as in a run: the base when the
        # replica is fresh to it, then each version's adapters.
        pool = RemotePool([url], offer, DEADLINES)
        pulls, seen = [], {}
        load = pool.clients[0].load_weights

        async def measured_load(version, uuid, timeout_s, **kwargs):
            out = await load(version, uuid, timeout_s, **kwargs)
            pulls.append((kwargs["part"], version, offered[uuid]))
            if kwargs["part"] == "base" and not seen:  # held, not served yet
                seen["held"], seen["before"] = out, await client.health(5.0)
            return out

        pool.clients[0].load_weights = measured_load
        got = {}
        await pool.start(1, adapters[1], base=staged_base)
        got[1] = await asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS))
        await pool.load_weights(2, adapters[2])
        got[2] = await asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS))
        await pool.close()
        await client.close()
        return seen["held"], seen["before"], got, pulls

    held, before, got, pulls = asyncio.run(main())
    assert held.version == -1 and before.version == -1 and not before.ready
    for v in (1, 2):
        for g, w in zip(got[v], want[v], strict=True):
            assert g.token_ids == w.token_ids and g.versions == [v] * len(g.token_ids)
            np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)
    # The adapters changed what is served (log-probs; a random tiny model repeats its bytes).
    assert not np.allclose(got[1][0].logprobs, got[2][0].logprobs, atol=1e-3)
    # What moved: a full-weights version is every weight of the engine in its dtype, what a
    # replica without LoRA pulls each version (``TransferSource.pull_targets``). The LoRA replica
    # pulled that once (the base), and from then on only a small fraction per version.
    whole = tree_nbytes(TransferSource(engine, offer.address).pull_targets())
    version_2 = sum(n for _, v, n in pulls if v == 2)
    assert 0 < version_2 * 4 < whole, (version_2, whole, pulls)  # here 176 KiB of 4.0 MiB
    assert [(part, v) for part, v, _ in pulls] == [("base", 1), ("adapters", 1), ("adapters", 2)]
    assert pulls[0][2] == whole
    log = _lines(stdout)
    assert sum("holds the LoRA base" in x for x in log) == 1, log
    assert [sum(f"serving version {v} " in x for x in log) for v in (1, 2)] == [1, 1], log


def test_a_replica_without_lora_refuses_a_base_or_adapters_by_name(replica, reference, offer):
    engine, params = reference
    staged = reshard(params[1], local_layout(engine.param_shardings))

    async def main():
        client = RemoteEngineClient(replica[0], replica=1, timeout_s=60.0)
        errors = []
        for part in ("base", "adapters"):
            with pytest.raises(WeightPullError) as err:
                await client.load_weights(1, offer.offer(staged), **PULL, part=part)
            errors.append(str(err.value))
        health = await client.health(5.0)
        await client.close()
        return errors, health

    errors, health = asyncio.run(main())
    for part, err in zip(("base", "adapters"), errors, strict=True):
        assert f"part {part!r}" in err and "serves whole weights" in err and "400" in err
    assert health.version == -1  # nothing was swapped in


def test_the_update_body_names_the_parts_allowed():
    from jaxrl_orch.serving.contract import UpdateWeights

    with pytest.raises(ValueError, match=r"'weights', 'base' or 'adapters'"):
        UpdateWeights.model_validate({"version": 1, "uuid": 2, "timeout_s": 1.0, "part": "lora"})
