"""The served tiny chat checkpoint the OpenAI-API test modules drive: ``host`` (an
``EngineHost`` with its own driver), ``url`` (it served over HTTP on loopback) and ``client``
(the official ``openai`` client pointed at it). One of each per test module."""

from __future__ import annotations

import httpx
import openai
import pytest
from support.openai_server import serve, tiny_chat_host


@pytest.fixture(scope="module")
def host(request, tmp_path_factory):
    name = request.module.__name__.rpartition(".")[2]
    host = tiny_chat_host(tmp_path_factory.mktemp(name) / "checkpoint")
    yield host
    host.stop()


@pytest.fixture(scope="module")
def url(host):
    with serve(host) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    http = httpx.Client(trust_env=False)  # loopback, whatever the proxy settings
    with openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http
    ) as c:
        yield c
