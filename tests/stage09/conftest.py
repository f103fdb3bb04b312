"""Stage-9 servers, one per model for the whole session (starting one takes seconds): a tiny
random model (byte-level tokenizer, with a chat template that prints a message's name), the real
default model (whose template does not), and a tiny one with every guard set tight."""

from __future__ import annotations

import shutil

import pytest

from serving_helpers import (
    CROWDED_ARGS,
    DEFAULT_ARGS,
    GUARD_ARGS,
    GUARD_KEY,
    NAMED_TEMPLATE,
    TINY_ARGS,
    TINY_FAMILY,
    Server,
)


def running(model, args: list[str], log_dir, **options):
    """A session's server: started, yielded, stopped."""
    server = Server(model, args, log_dir, **options)
    yield server
    server.stop()


def alive(server: Server) -> Server:
    """The server, checked alive before a test (a dead one says why). Whether it still answers is
    checked for every test that uses a server (tests/conftest.py, Server.check_answering)."""
    server.check_alive()
    return server


@pytest.fixture(scope="session")
def tiny_server_session(tiny_models_root, tmp_path_factory):
    model = tmp_path_factory.mktemp("s09-named-template") / TINY_FAMILY
    shutil.copytree(tiny_models_root / TINY_FAMILY, model)
    (model / "chat_template.jinja").write_text(NAMED_TEMPLATE)
    yield from running(model, TINY_ARGS, tmp_path_factory.mktemp("s09-tiny-server"))


@pytest.fixture
def tiny_server(tiny_server_session):
    return alive(tiny_server_session)


# The other servers start after the tiny one: where it cannot start (an unwritten stage), they
# fail at once with its error instead of spending half a minute each to fail the same way.
@pytest.fixture(scope="session")
def default_server_session(tiny_server_session, default_model_dir, tmp_path_factory):
    yield from running(default_model_dir, DEFAULT_ARGS, tmp_path_factory.mktemp("s09-default-server"))


@pytest.fixture
def default_server(default_server_session):
    return alive(default_server_session)


@pytest.fixture(scope="session")
def guarded_server_session(tiny_server_session, tiny_models_root, tmp_path_factory):
    yield from running(
        tiny_models_root / TINY_FAMILY, GUARD_ARGS, tmp_path_factory.mktemp("s09-guarded-server"), api_key=GUARD_KEY
    )


@pytest.fixture
def guarded_server(guarded_server_session):
    return alive(guarded_server_session)


@pytest.fixture(scope="session")
def crowded_server_session(tiny_server_session, tiny_models_root, tmp_path_factory):
    yield from running(tiny_models_root / TINY_FAMILY, CROWDED_ARGS, tmp_path_factory.mktemp("s09-crowded-server"))


@pytest.fixture
def crowded_server(crowded_server_session):
    return alive(crowded_server_session)
