"""``python -m support.group_netns_worker K COORDINATOR`` (``tests/`` on ``PYTHONPATH``): process K
of a 2-process trainer group (2 fake CPU devices) on a host of its own (``support.netns``),
joined as the train command joins it (``group.join_group``, no host address given), then one
cross-process collective; prints what it gathered."""

from __future__ import annotations

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxrl_orch.distributed.group import join_group, resolve_role  # noqa: E402

k, coordinator = int(sys.argv[1]), sys.argv[2]
join_group(resolve_role(2, 1, k), coordinator)
gathered = multihost_utils.process_allgather(np.array([k + 1]))
# One string, one write: gloo's own log lines (C++, the same stream) cannot land inside it.
print(f"gathered {gathered.ravel().tolist()}", flush=True)
# The test reads the socket tables every 0.2 s: the collectives' listeners stay up a while.
time.sleep(2.0)
