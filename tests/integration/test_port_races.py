"""No start races for a port (issue #32 point 4): a server whose port another process took between the pick
and the bind is started again on a new port, logged, instead of failing the run.

Seen in CI: an engine's port handed out again as an ephemeral one before the engine bound it (``address
already in use``, ProcessStartError), and the router's Prometheus port taken the same way
(``PanicException: failed to install Prometheus metrics exporter:
FailedToCreateHTTPListener("Address already in use (os error 98)")``). Each test occupies, with a listening
socket of its own, the port a start was about to use: the engine and the router directly, the engine task of a
Slurm rollout step (``python -m hpcrl.slurm.rollout_step``, run here as its own process), and a whole
``hpcrl run`` whose port picker hands out taken ports first (a ``sitecustomize`` on the run's
``PYTHONPATH``, :data:`PICKER`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.config import Config
from hpcrl.procs import ProcessStartError, listens_on
from hpcrl.rollout.engines import LocalEngineLaunch, spawn_engine

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def taken_ports(n: int = 1):
    """``n`` ports on 127.0.0.1 held by listening sockets of this process (what another server would hold)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            socks.append(s)
        yield [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def secret_file(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.write_text("k" * 32)
    secret.chmod(0o600)
    return secret


def test_engine_whose_port_is_taken_starts_again_on_another(tmp_path, tiny_model_dir):
    cfg = Config()
    secret = secret_file(tmp_path)
    with taken_ports() as (port,):
        eng = spawn_engine(cfg.rollout, {}, tiny_model_dir, port=port, api_key_file=secret,
                           log_path=tmp_path / "engine-0.log")
        launch = LocalEngineLaunch([eng], secret, cfg, tmp_path, tiny_model_dir)
        try:
            engines, _ = launch.wait()
            assert "address already in use" in (tmp_path / "engine-0.log").read_text()
            assert engines[0].url != eng.url and engines[0].process.poll() is None
            assert listens_on(engines[0].pid, int(engines[0].url.rsplit(":", 1)[1]))
            assert (tmp_path / "engine-0.port-retry-1.log").exists()
        finally:
            launch.stop()


def test_start_engine_whose_picked_port_is_taken_starts_again(tmp_path, tiny_model_dir, monkeypatch, caplog):
    """``start_engine`` (one engine, the tests' and tools' helper) picks a port and retries like a run's launch:
    seen in CI (2026-12-07, ``test_partial_response_kept_when_the_engine_dies``): ``address already in use``."""
    from hpcrl.rollout import engines as engines_mod

    real = engines_mod.find_free_port
    with taken_ports() as (port,):
        picks = iter([port])
        monkeypatch.setattr(engines_mod, "find_free_port", lambda *a, **k: next(picks, None) or real(*a, **k))
        eng = engines_mod.start_engine(Config().rollout, {}, tiny_model_dir, api_key_file=secret_file(tmp_path),
                                       log_path=tmp_path / "engine.log", startup_timeout_s=120)
        try:
            assert "address already in use" in (tmp_path / "engine.log").read_text()
            assert eng.url != f"http://127.0.0.1:{port}" and eng.process.poll() is None
            assert listens_on(eng.pid, int(eng.url.rsplit(":", 1)[1]))
            assert (tmp_path / "engine.port-retry-1.log").exists()
            assert "was taken before it could bind it" in caplog.text
        finally:
            eng.stop()
        # a port the caller chose is the caller's: no second start on another
        with pytest.raises(ProcessStartError, match="address already in use"):
            engines_mod.start_engine(Config().rollout, {}, tiny_model_dir, port=port,
                                     api_key_file=secret_file(tmp_path), log_path=tmp_path / "fixed.log",
                                     startup_timeout_s=120)
        assert not list(tmp_path.glob("fixed.port-retry-*"))


def test_router_whose_ports_are_taken_starts_again(tmp_path, monkeypatch, caplog):
    """Both of the router's ports: the Prometheus port (the CI failure) and its main port, each taken after
    the pick; it serves on new ones. A main port the caller pinned is the caller's to handle: not retried."""
    import hpcrl.rollout.router as router_mod

    real = router_mod.find_free_port
    with taken_ports(3) as (main, prometheus, pinned):
        picks = iter([main, prometheus])
        monkeypatch.setattr(router_mod, "find_free_port", lambda host="": next(picks, None) or real(host))
        with caplog.at_level("WARNING", logger="hpcrl.rollout.router"):
            router = router_mod.start_router([], api_key="r" * 32, log_path=tmp_path / "router.log",
                                             startup_timeout_s=60)
        try:
            assert router.alive() and router.url.rsplit(":", 1)[1] != str(main)
            assert router.prometheus_port != prometheus
            log = (tmp_path / "router.log").read_text()
            assert ("Prometheus metrics exporter" in log
                    and "Error starting router: Address already in use" in log)
            warned = [r.getMessage() for r in caplog.records]
            assert any("prometheus port" in w and str(prometheus) in w for w in warned), warned
            assert any("main port" in w and str(main) in w for w in warned), warned
            assert router.list_workers() == []  # it answers, with the key
        finally:
            router.stop()
        with pytest.raises(ProcessStartError, match="exited"):
            router_mod.start_router([], port=pinned, log_path=tmp_path / "pinned.log", startup_timeout_s=60)


def test_slurm_engine_task_whose_port_is_taken_starts_again(tmp_path, tiny_model_dir):
    """The engine task of a rollout step (what ``srun`` runs on each node): its engine exits on the taken
    port, the task starts it on a new one, rewrites its address file (which the controller reads again) and
    passes SIGTERM on at the end."""
    from hpcrl.slurm.rollout_step import ENGINES_DIR, _is_ours

    secret = secret_file(tmp_path)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{path: {tiny_model_dir}}}\nrollout: {{engine: cpu}}\n")
    (tmp_path / ENGINES_DIR).mkdir()
    address = tmp_path / ENGINES_DIR / "engine-0.json"
    log = open(tmp_path / "engine-0.log", "wb")
    with taken_ports() as (port,):
        task = subprocess.Popen([sys.executable, "-m", "hpcrl.slurm.rollout_step", "--config", str(cfg),
                                 "--model-path", str(tiny_model_dir), "--attempt-dir", str(tmp_path),
                                 "--secret", str(secret), "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, SLURM_PROCID="0", SLURMD_NODENAME="127.0.0.1",
                                         OMP_NUM_THREADS="1"))
        try:
            deadline = time.monotonic() + 120
            while True:
                assert task.poll() is None, (tmp_path / "engine-0.log").read_text()[-3000:]
                url = json.loads(address.read_text())["url"] if address.exists() else ""
                if url and not url.endswith(f":{port}") and _is_ours(url, "k" * 32):
                    break
                assert time.monotonic() < deadline, (tmp_path / "engine-0.log").read_text()[-3000:]
                time.sleep(0.2)
            text = (tmp_path / "engine-0.log").read_text()
            assert "address already in use" in text and f"port {port} was taken" in text, text[-3000:]
            assert json.loads(address.read_text())["pid"] == task.pid
        finally:
            task.send_signal(signal.SIGTERM)
            rc = task.wait(timeout=60)
            log.close()
    assert rc == 0  # the engine shut down on the forwarded SIGTERM and the task reports its status


PICKER = '''
import os, sys
_taken = [int(p) for p in os.environ.get("HPCRL_TEST_TAKEN_PORTS", "").split(",") if p]
if _taken:  # the first picks of the engine's and the router's ports answer ports the test holds
    import hpcrl.procs as _procs

    _real, _calls = _procs.find_free_port, {}
    _plan = {"spawn_engine": _taken[:1], "spawn_router": _taken[1:3]}

    def find_free_port(host="127.0.0.1"):
        caller = sys._getframe(1).f_code.co_name
        n = _calls[caller] = _calls.get(caller, -1) + 1
        planned = _plan.get(caller, [])
        return planned[n] if n < len(planned) else _real(host)

    _procs.find_free_port = find_free_port
'''


def test_a_run_whose_ports_are_taken_completes(tmp_path):
    """``hpcrl run`` whose engine port and both router ports are taken between pick and bind: the engine is
    started once more, the router twice more, and the run completes with every step trained."""
    from tests.integration.test_fault_tolerance import log_of, start
    from tests.integration.test_preemption_local import steps_done

    (tmp_path / "sitecustomize.py").write_text(PICKER)
    with taken_ports(3) as ports:
        os.environ["HPCRL_TEST_TAKEN_PORTS"] = ",".join(map(str, ports))
        try:
            proc = start(tmp_path, "ports", steps=3, new_interpreter=True)  # sitecustomize runs at its start
        finally:
            del os.environ["HPCRL_TEST_TAKEN_PORTS"]
        assert proc.wait(timeout=300) == 0, log_of(tmp_path, "ports")[-3000:]
    run_dir = tmp_path / "runs" / "ports"
    assert steps_done(run_dir) == 3
    attempt = run_dir / "logs" / "attempt-0"
    assert "address already in use" in (attempt / "engine-0.log").read_text()
    assert (attempt / "engine-0.port-retry-1.log").exists()
    router_log = (attempt / "router.log").read_text()
    assert ("Prometheus metrics exporter" in router_log
            and "Error starting router: Address already in use" in router_log)
    log = log_of(tmp_path, "ports")
    assert log.count("started again") == 3, log[-3000:]  # the engine once, the router's two ports
