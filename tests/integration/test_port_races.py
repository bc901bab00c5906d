"""An engine whose port was taken between picking it and binding it (the OS hands a released port out again
as an ephemeral one, e.g. to a gloo connection of the trainer starting beside it) is started again on another
port instead of failing the run (seen once in CI: ``address already in use``, ProcessStartError)."""

from __future__ import annotations

import socket

import pytest

from hpcrl.config import Config
from hpcrl.rollout.engines import LocalEngineLaunch, spawn_engine

pytestmark = pytest.mark.integration


def test_engine_whose_port_is_taken_starts_again_on_another(tmp_path, tiny_model_dir):
    cfg = Config()
    secret = tmp_path / "secret"
    secret.write_text("k" * 32)
    secret.chmod(0o600)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        eng = spawn_engine(cfg.rollout, {}, tiny_model_dir, port=port, api_key_file=secret,
                           log_path=tmp_path / "engine-0.log")
        launch = LocalEngineLaunch([eng], secret, cfg, tmp_path, tiny_model_dir)
        try:
            engines, _ = launch.wait()
            assert "address already in use" in (tmp_path / "engine-0.log").read_text()
            assert engines[0].url != eng.url and engines[0].process.poll() is None
            assert (tmp_path / "engine-0.port-retry.log").exists()
        finally:
            launch.stop()
