"""Stage-9 servers, one per model for the whole session (starting one takes seconds): a tiny
random model (byte-level tokenizer, with a chat template) and the real default model."""

from __future__ import annotations

import pytest

from serving_helpers import Server

TINY_FAMILY = "llama"
# The tiny server: room for 40+ requests at once, a 1024-token context (the tiny models' own).
TINY_ARGS = ["--pool-size", "4096", "--max-running-requests", "48"]
DEFAULT_ARGS = ["--pool-size", "2048"]


@pytest.fixture(scope="session")
def tiny_server_session(tiny_models_root, tmp_path_factory):
    server = Server(tiny_models_root / TINY_FAMILY, TINY_ARGS, tmp_path_factory.mktemp("s09-tiny-server"))
    yield server
    server.stop()


@pytest.fixture
def tiny_server(tiny_server_session):
    """The tiny model's server, checked alive before each test (a dead one says why)."""
    tiny_server_session.check_alive()
    return tiny_server_session


@pytest.fixture(scope="session")
def default_server_session(default_model_dir, tmp_path_factory):
    server = Server(default_model_dir, DEFAULT_ARGS, tmp_path_factory.mktemp("s09-default-server"))
    yield server
    server.stop()


@pytest.fixture
def default_server(default_server_session):
    default_server_session.check_alive()
    return default_server_session
