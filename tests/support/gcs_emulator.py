"""A local Google Cloud Storage emulator (``gcp-storage-emulator``, in memory) for the tests
of ``gs://`` workdirs, and the environment that points every client at it: ``gcsfs`` (epath's
backend) and google-cloud-storage (tensorboardX's) read ``STORAGE_EMULATOR_HOST``, tensorstore
(orbax's) reads ``TENSORSTORE_GCS_HTTP_URL`` with a test token.

One gap of the stub emulator is closed here: real GCS answers a download with the object's
``x-goog-generation`` header, which tensorstore needs for the conditional rewrites of an OCDBT
manifest (orbax's checkpoint format); the emulator omits it, so its download handler is
wrapped to send it."""

from __future__ import annotations

import logging
import os
import socket

BUCKET = "jaxrl-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _send_generation_headers() -> None:
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    original = objects.download
    if getattr(original, "sends_generation", False):
        return

    def download(request, response, storage, *args, **kwargs):
        original(request, response, storage, *args, **kwargs)
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except Exception:  # noqa: BLE001 - not found: the original answered 404 already
            return
        response["x-goog-generation"] = obj["generation"]
        response["x-goog-metageneration"] = obj["metageneration"]

    download.sends_generation = True
    for _, handlers in server.HANDLERS:
        for method, fn in list(handlers.items()):
            if fn is original:
                handlers[method] = download
    objects.download = download


def client_env(url: str) -> dict[str, str]:
    """What points every storage client of a process at the emulator serving at ``url``."""
    return {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
        "GOOGLE_CLOUD_PROJECT": "test-project",
        # gcsfs asks the Storage Control API for each bucket's layout (hierarchical or not)
        # before its operations, and asks again after a failed answer; the emulator serves the
        # JSON API only, so every write paid a failed credentials probe (seconds where no
        # metadata server answers): the plain JSON-API client, as gcsfs falls back to.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


class Emulator:
    """Served by a thread of this process on ``host`` (an address or name) and ``port``."""

    def __init__(self, host: str = "localhost", port: int | None = None) -> None:
        from gcp_storage_emulator.server import create_server

        _send_generation_headers()
        logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.server = create_server(host, self.port, in_memory=True, default_bucket=BUCKET)
        self.server.start()

    @property
    def env(self) -> dict[str, str]:
        return client_env(self.url)

    def point_here(self) -> None:
        """Point this process's clients at the emulator (before its first gs:// use)."""
        os.environ.update(self.env)

    def stop(self) -> None:
        self.server.stop()


def main() -> None:
    """``python -m support.gcs_emulator HOST PORT``: serve until SIGTERM, for hosts this process
    does not share a network with (``test_gke_pods_e2e``); prints ``serving`` once it does."""
    import signal
    import sys
    import threading

    host, port = sys.argv[1], int(sys.argv[2])
    emulator = Emulator(host, port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("serving", flush=True)
    stop.wait()
    emulator.stop()


if __name__ == "__main__":
    main()
