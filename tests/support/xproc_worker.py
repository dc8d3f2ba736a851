"""One side of the two-process reshard test (run by test_sharding_reshard.py, not by pytest).

Usage: python -m support.xproc_worker PROCESS_ID COORDINATOR_PORT SOCKET_PORT RESULT_JSON

Process 0 owns the trainer mesh (its 4 devices) and sends; process 1 owns the decode mesh and
receives. Both build the same reference params from a fixed seed, so the receiver can check
bit-equality without the sender shipping its values any other way. Exits non-zero on failure.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sharding.mesh import make_meshes  # noqa: E402
from sharding.reshard import reshard_cross_process  # noqa: E402
from sharding.rules import DECODE_RULES, TRAINER_RULES, resolve_shardings  # noqa: E402

LOGICAL = {
    "embedding": ("vocab", "embed"),
    "q": ("embed", "heads", "head_dim"),
    "odd_heads": ("embed", "heads", "head_dim"),  # 6 heads: tp=4 falls back to replication
    "norm": ("norm",),
    "step": (),
}


def reference() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "embedding": rng.standard_normal((64, 32), dtype=np.float32),
        "q": rng.standard_normal((32, 4, 8), dtype=np.float32),
        "odd_heads": rng.standard_normal((32, 6, 8), dtype=np.float32),
        "norm": rng.standard_normal((32,), dtype=np.float32),
        "step": np.array(7, dtype=np.int32),
    }


def main() -> None:
    pid, coord_port, sock_port, result_path = sys.argv[1:5]
    pid = int(pid)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{sock_port}")
    jax.distributed.initialize(f"127.0.0.1:{coord_port}", num_processes=2, process_id=pid)

    decode, trainer = make_meshes({"tp": 4}, {"fsdp": 2, "tp": 2})
    assert {d.process_index for d in trainer.devices.flat} == {0}, trainer
    assert {d.process_index for d in decode.devices.flat} == {1}, decode
    ref = reference()
    src_sh = resolve_shardings(LOGICAL, trainer, TRAINER_RULES, shapes=ref)
    dst_sh = resolve_shardings(LOGICAL, decode, DECODE_RULES, shapes=ref)
    checks = []

    def source():
        if pid == 0:
            return jax.device_put(ref, src_sh)
        return {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=src_sh[k]) for k, v in ref.items()
        }

    for dtype, donate in ((None, False), (jnp.bfloat16, True)):
        tree = source()
        out = reshard_cross_process(tree, dst_sh, dtype=dtype, donate=donate)
        jax.block_until_ready(out)
        for k, want in ref.items():
            got = out[k]
            assert got.sharding == dst_sh[k], (k, got.sharding, dst_sh[k])
            if pid == 1:
                expect = want.astype(dtype) if dtype is not None and k != "step" else want
                host = np.asarray(got)
                assert host.dtype == expect.dtype, (k, host.dtype, expect.dtype)
                assert host.tobytes() == expect.tobytes(), f"{k} values differ (dtype={dtype})"
                assert {d.id for d in got.devices()} <= {d.id for d in decode.devices.flat}
            elif donate and k != "step":
                # Cast leaves were copied on the source, so the donated originals are free now;
                # "step" is sent from its own buffers, which the transfer still reads.
                assert tree[k].is_deleted(), f"donated source {k} still alive"
            checks.append(f"{k}:{dtype}:{donate}")
    with open(result_path, "w") as f:
        json.dump({"process": pid, "checks": checks}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
