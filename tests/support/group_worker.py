"""``python -m support.group_worker K PORT OUT`` (``tests/`` on ``PYTHONPATH``): process K of a
2-process trainer group (2 fake devices each). The leader sends TRAIN (arrays), CHECKPOINT (a
body) and STOP through ``group.Channel``; both stage a params tree through
``group.EngineStager``; each writes what it received and its staged local copy to ``OUT/K.npz``
for the test to compare."""

from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from jaxrl_orch.distributed.group import (
    CHECKPOINT,
    STOP,
    TRAIN,
    Channel,
    EngineStager,
    join_group,
    resolve_role,
)  # noqa: E402,E501

k, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
role = join_group(resolve_role(2, 1, k), f"127.0.0.1:{port}")
assert role.process_index == k and jax.process_count() == 2


def listeners(port: int) -> list[str]:
    """The local addresses of this machine's TCP sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(host)
                # /proc writes each 32-bit word in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                ip = ipaddress.ip_address(words)
                found.append(str(getattr(ip, "ipv4_mapped", None) or ip))  # ::ffff:a.b.c.d
    return found


# The coordinator (process 0) listens on the address it was given, not on every interface.
coordinator = listeners(int(port)) if role.leader else []
channel = Channel(leader=role.leader)
got: dict = {}
if role.leader:
    batch = {"tokens": np.arange(24, dtype=np.int32).reshape(4, 6), "adv": np.full((4, 6), 0.5)}
    channel.send(TRAIN, {}, batch)
    channel.send(CHECKPOINT, {"step": 3, "state": {"cursor": [1, 2], "name": "é"}})
    channel.send(STOP, {})
    got = {"train": batch, "body": {"step": 3, "state": {"cursor": [1, 2], "name": "é"}}}
else:
    cmd, body, arrays = channel.receive()
    assert cmd == TRAIN and body == {}, (cmd, body)
    got["train"] = arrays
    cmd, body, _ = channel.receive()
    assert cmd == CHECKPOINT, cmd
    got["body"] = body
    cmd, _, _ = channel.receive()
    assert cmd == STOP

# Params on the group's 4-device trainer mesh (fsdp), staged into a tp=2 decode layout.
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
trainer_mesh = Mesh(np.array(devices), ("fsdp",))
full = {"w": np.arange(8 * 6, dtype=np.float32).reshape(8, 6), "b": np.arange(6, dtype=np.float32)}
params = {
    "w": jax.device_put(full["w"], NamedSharding(trainer_mesh, PartitionSpec("fsdp", None))),
    "b": jax.device_put(full["b"], NamedSharding(trainer_mesh, PartitionSpec())),
}
decode_mesh = Mesh(np.array(jax.local_devices()), ("tp",))
layout = {
    "w": NamedSharding(decode_mesh, PartitionSpec(None, "tp")),
    "b": NamedSharding(decode_mesh, PartitionSpec("tp")),
}
stager = EngineStager(trainer_mesh, layout, jnp.bfloat16)
local = stager.local(stager.stage(params))
for name, x in local.items():
    assert x.is_fully_addressable and x.dtype == jnp.bfloat16, (name, x.dtype)
    assert {d.process_index for d in x.sharding.device_set} == {k}
    assert x.sharding.spec == layout[name].spec and x.sharding.mesh.shape == decode_mesh.shape
    # Shard for shard what the layout asks: tp splits w's columns over this process's devices.
    shard_shapes = sorted(s.data.shape for s in x.addressable_shards)
    want = sorted(layout[name].shard_shape(x.shape) for _ in x.addressable_shards)
    assert shard_shapes == want, (name, shard_shapes, want)
np.savez(
    os.path.join(out, f"{k}.npz"),
    tokens=got["train"]["tokens"],
    adv=got["train"]["adv"],
    body=json.dumps(got["body"]),
    coordinator=json.dumps(coordinator),
    w=np.asarray(local["w"].astype(jnp.float32)),
    b=np.asarray(local["b"].astype(jnp.float32)),
)
jax.distributed.shutdown()
