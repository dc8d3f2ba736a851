"""The check that a loss is exact under gradient accumulation: ``run(rows)`` gives ``(loss,
metric sums)`` of a row slice; the single rows' losses add up to the whole batch's and their
metric sums merge (``losses.merge_metric_sums``) into the whole batch's."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxrl_orch.algorithms import losses


def assert_rows_add_up(run: Callable[[slice], tuple], n_rows: int) -> None:
    whole_loss, whole = run(slice(None))
    parts = [run(slice(i, i + 1)) for i in range(n_rows)]
    merged = parts[0][1]
    for _, sums in parts[1:]:
        merged = losses.merge_metric_sums(merged, sums)
    np.testing.assert_allclose(sum(float(p[0]) for p in parts), float(whole_loss), rtol=1e-5)
    for k in whole:
        np.testing.assert_allclose(float(merged[k]), float(whole[k]), rtol=1e-5, err_msg=k)
