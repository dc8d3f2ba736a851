"""Small bundled datasets built once per test session into a temporary data_dir."""

import pytest

from jaxrl_orch.data.builders import ArithmeticConfig, ReverseTextConfig, prepare


@pytest.fixture(scope="session")
def tiny_reverse():
    return ReverseTextConfig(name="tiny_test", num_eval=40, max_train=160, split_seed=3)


@pytest.fixture(scope="session")
def tiny_arith():
    return ArithmeticConfig(name="tiny_test", num_train=120, num_eval=30, seed=5)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, tiny_reverse, tiny_arith):
    d = tmp_path_factory.mktemp("tfds")
    prepare("reverse_text", d, tiny_reverse)
    prepare("arithmetic", d, tiny_arith)
    return d
