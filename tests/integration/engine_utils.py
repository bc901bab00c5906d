"""Start and stop an hpcrl engine server subprocess for tests (free loopback port, health wait, log file).

Usage::

    with EngineProcess(model_dir, log_path=tmp_path / "engine.log") as eng:
        status, body = http_json("POST", eng.url + "/generate", {"text": "1+1=", ...})

Also used by the router tests. Everything is bounded in time: start waits at most ``start_timeout`` seconds
for ``/health`` to answer 200, stop escalates from SIGTERM to SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_json(method: str, url: str, body: Any = None, headers: dict | None = None,
              timeout: float = 60.0) -> tuple[int, Any]:
    """Send one HTTP request with a JSON body; return ``(status, parsed JSON or text or None)``.

    Never raises for HTTP error statuses (4xx/5xx come back as the status); raises URLError/TimeoutError on
    connection failures.
    """
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    if not raw:
        return status, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class EngineProcess:
    """An ``python -m hpcrl.engine.server`` subprocess on 127.0.0.1.

    ``model_path``: HF folder. ``extra_args``: more server flags. ``log_path``: where stdout/stderr go
    (default: a file next to nothing, i.e. ``engine-<port>.log`` in the current directory). ``threads``:
    OMP/torch threads for the server (tests keep this small on shared machines).
    """

    def __init__(self, model_path: str | os.PathLike, extra_args: list[str] | tuple[str, ...] = (),
                 log_path: str | os.PathLike | None = None, threads: int = 1, port: int | None = None,
                 env: dict[str, str] | None = None):
        self.model_path = str(model_path)
        self.extra_args = list(extra_args)
        self.port = port
        self.log_path = Path(log_path) if log_path else None
        self.threads = threads
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self) -> None:
        if self.port is None:
            self.port = free_port()
        if self.log_path is None:
            self.log_path = Path(f"engine-{self.port}.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads),
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               **self.env}
        cmd = [sys.executable, "-m", "hpcrl.engine.server", "--model-path", self.model_path,
               "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log_tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters of the server log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:] if self.log_path else ""
        except OSError:
            return ""

    def start(self, start_timeout: float = 120.0, attempts: int = 3) -> "EngineProcess":
        """Spawn the server and wait until ``/health`` answers 200.

        Retries on a new port if the process exits early (e.g. the port was taken). Raises RuntimeError with
        the log tail if it does not come up within ``start_timeout`` seconds per attempt.
        """
        fixed_port = self.port is not None
        for attempt in range(attempts):
            self._spawn()
            deadline = time.monotonic() + start_timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    status, _ = http_json("GET", self.url + "/health", timeout=2.0)
                    if status == 200:
                        return self
                except (OSError, urllib.error.URLError):
                    pass
                time.sleep(0.2)
            exited = self.proc.poll() is not None
            self.stop()
            if not exited or fixed_port or attempt == attempts - 1:
                raise RuntimeError(f"engine did not become healthy on port {self.port}:\n{self.log_tail()}")
            self.port = None
        raise RuntimeError("unreachable")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL. Safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "EngineProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --- the harness of the engine tests that sync a megatron-core trainer into the engine -------------------


def key_file(folder: Path, key: str) -> Path:
    """Write the engines' API ``key`` to ``folder/key`` with mode 0600 (as the launcher writes the run
    secret, which the server refuses otherwise); returns the path."""
    path = Path(folder) / "key"
    path.write_text(key + "\n")
    os.chmod(path, 0o600)
    return path


def keyed_engine(model_path: str | os.PathLike, key_path: str | os.PathLike, log_path: str | os.PathLike,
                 extra_args: list[str] | tuple[str, ...] = ()) -> EngineProcess:
    """An :class:`EngineProcess` serving ``model_path`` behind the key in ``key_path`` with a 60 s
    ``--dist-timeout``, logging to ``log_path`` (not yet started: use it as a context manager)."""
    return EngineProcess(model_path, ["--api-key-file", str(key_path), "--dist-timeout", "60", *extra_args],
                         log_path=log_path)


@contextlib.contextmanager
def trainer_model(model_path: str | os.PathLike, ep: int = 1):
    """The megatron-core model (DDP-wrapped, ``TrainSection()`` defaults, one thread) of the HF folder
    ``model_path`` at TP=1 and expert-parallel size ``ep``, as ``(model, global rank)``: in this process at
    ``ep`` 1, on each rank of a ``torchrun --nproc_per_node=ep`` worker otherwise (the ranks meet at a barrier
    when the block ends). The model-parallel state is torn down after."""
    import torch
    import torch.distributed as dist

    from hpcrl.config import TrainSection
    from hpcrl.train import model as tmodel
    from hpcrl.train import parallel

    torch.set_num_threads(1)
    env = parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1, ep=ep)
    parallel.model_parallel_cuda_manual_seed(1234)
    try:
        model, _ = tmodel.setup_model_and_optimizer(model_path, TrainSection())
        yield model, env.rank
        if ep > 1:
            dist.barrier()
    finally:
        parallel.destroy()


def local_trainer(model_path: str | os.PathLike):
    """Generator for a module fixture: :func:`trainer_model`'s model of ``model_path`` at TP=1 in this
    process."""
    with trainer_model(model_path) as (model, _):
        yield model


def perturb(model, seed: int, scale: float = 0.05) -> None:
    """Add seeded N(0, ``scale``^2) noise to every parameter of ``model`` (an HF model or a megatron one,
    wrapped or not) in place: the same noise on every rank for same-shaped shards."""
    import torch

    from hpcrl.train.bridge import unwrap_model

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in unwrap_model(model).parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def prefill_logprobs(url: str, seqs: list[list[int]], key: str | None, reported=None,
                     timeout: float = 60) -> tuple[list[list[float]], str]:
    """The engine's ``input_token_logprobs`` (entries 1..n-1, temperature 1, nothing generated) of each token
    sequence of ``seqs`` and its weight_version; ``key``: the API key (None: no Authorization header). Checks
    that the engine scored exactly ``seq`` (the first entry has no log-prob): the ids it reports are ``seq``,
    or ``reported(seq)`` where an engine reports some ids otherwise (real SGLang: tests/sglang)."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    out, version = [], None
    for seq in seqs:
        status, body = http_json("POST", url + "/generate", {
            "input_ids": seq, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0}, headers=headers, timeout=timeout)
        assert status == 200, body
        triples = body["meta_info"]["input_token_logprobs"]
        assert triples[0][0] is None and [t[1] for t in triples] == (seq if reported is None else reported(seq))
        out.append([t[0] for t in triples[1:]])
        version = body["meta_info"]["weight_version"]
    return out, version


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest absolute difference between two equally shaped lists of per-sequence log-probs."""
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


async def sync_weights(url: str, key: str, stream, version: str, method: str = "tensor", sender: bool = True,
                       bucket_bytes: int = 64 * 1024, **kwargs) -> dict:
    """One weight sync of ``stream`` ((HF name, tensor) pairs) to the engine at ``url`` as ``version``
    with ``method`` in buckets of ``bucket_bytes``; ``sender``: this rank posts (the others only take part in
    the export collectives); ``kwargs``: more WeightSyncer fields (``disk_dir``, ``hf_checkpoint``). Returns
    the syncer's metrics."""
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.weights import WeightSyncer

    client = RolloutClient(engine_urls=[url], api_key=key) if sender else None
    syncer = WeightSyncer(client, method, bucket_bytes=bucket_bytes, timeout_s=60, is_sender=sender,
                          **kwargs)
    try:
        return await syncer.sync(iter(stream), version)
    finally:
        await syncer.close()
        if client is not None:
            await client.close()


async def sync_trainer(url: str, key: str, model, version: str, method: str = "tensor", sender: bool = True,
                       drop_suffix: str | None = None, **kwargs) -> dict:
    """:func:`sync_weights` of a megatron-core trainer's export (``hpcrl.weights.iterate_for_sync``: every
    rank iterates it, a collective; ``sender`` posts it); ``drop_suffix``: leave the names ending with it out
    of the stream (a trainer that does not sync them)."""
    from hpcrl.weights import iterate_for_sync

    stream = iterate_for_sync(model)
    if drop_suffix is not None:
        stream = ((name, t) for name, t in stream if not name.endswith(drop_suffix))
    return await sync_weights(url, key, stream, version, method, sender=sender, **kwargs)


def sync_worker_main(worker) -> None:
    """The ``__main__`` of a test file that is also the rank worker of :func:`run_two_rank_sync`: parse
    ``--model DIR --url URL --out DIR`` and call ``worker(model, url, out)``."""
    import argparse

    parser = argparse.ArgumentParser(description=worker.__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    worker(args.model, args.url, args.out)


def run_ranks(script: str | os.PathLike, args: list[str], out: Path, nprocs: int = 2,
              timeout: float = 600) -> None:
    """Run ``script args --out out`` as ``nprocs`` ranks with torchrun's variables (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: gloo on a free loopback port), one
    thread per rank; each rank's output goes to ``out/rank{r}.log`` (a file, not a pipe: a torch_shm_manager that
    CPU tensor payloads start inherits the rank's stdout and outlives it).

    The ranks are forked from this test process's fork server (:func:`hpcrl.launch_local.worker_context`, as
    ``hpcrl run`` starts its trainer processes): torch, megatron-core and the trainer are imported once per test
    process instead of once per rank, and no torchrun agent is started (issue #52: a 2-rank job's imports were
    most of its CPU; the multi-rank megatron tests took 292 core-seconds under torchrun, 137 so). The script
    runs as ``__main__`` (:func:`runpy.run_path`). Fails the test with the logs' tails when a rank exits non-zero
    (the others are stopped: they would wait for it in a collective) or after ``timeout`` seconds."""
    from multiprocessing import connection

    from hpcrl.launch_local import worker_context

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ctx = worker_context()
    procs = [ctx.Process(target=_rank_main, args=(str(script), [*args, "--out", str(out)], r, nprocs, port,
                                                  str(out / f"rank{r}.log")), name=f"rank-{r}")
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        alive = list(procs)
        while alive and time.monotonic() < deadline:
            connection.wait([p.sentinel for p in alive], timeout=1.0)
            alive = [p for p in alive if p.exitcode is None]
            if any(p.exitcode for p in procs if p.exitcode is not None):
                break
    finally:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
            p.join()
    codes = [p.exitcode for p in procs]
    if codes != [0] * nprocs:
        tails = "\n".join(f"--- rank {r} (exit {c}):\n" + (out / f"rank{r}.log").read_text(errors="replace")[-4000:]
                          for r, c in enumerate(codes))
        pytest.fail(f"{script} failed on {nprocs} ranks (exit codes {codes}; timeout {timeout} s):\n{tails}")


def _rank_main(script: str, argv: list[str], rank: int, world_size: int, port: int, log: str) -> None:
    """One rank of :func:`run_ranks`: stdout and stderr to ``log``, torchrun's variables, one thread, then
    ``script`` as ``__main__`` with ``argv`` (its folder first on ``sys.path``, as ``python script`` has it)."""
    import runpy
    import warnings

    import torch

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")


def run_two_rank_sync(script: str | os.PathLike, args: list[str], out: Path,
                      timeout: float = 600) -> list[dict]:
    """Run ``script args --out out`` on 2 ranks (:func:`run_ranks`) and return each rank's
    ``out/rank{r}.json``. Fails the test with the ranks' log tails when one exits non-zero."""
    run_ranks(script, args, out, 2, timeout)
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]


def load_file_module(path: Path, module_name: str, search: Path):
    """Execute the Python file ``path`` as a new module ``module_name`` (tests/ and benchmarks/ are not
    packages), with ``search`` put onto ``sys.path`` first for the file's own imports; returns the module."""
    import importlib.util

    if str(search) not in sys.path:
        sys.path.insert(0, str(search))
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_benchmark(name: str):
    """Load ``benchmarks/{name}.py`` as a module (benchmarks/ on ``sys.path`` for its own imports: machine,
    weight_sync)."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    return load_file_module(bench / f"{name}.py", f"hpcrl_bench_{name}", bench)


# --- a streamed response across an in-flight weight update (the pause-mode tests) ------------------------

ACROSS_PROMPT = [1, 5, 9]
ACROSS_PARAMS = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}
"""Temperature 1: the engine's sampled log-probs are plain log-softmaxes, comparable with a transformers
forward. 240 tokens: ~1 s of decoding on the tiny model, so the response is still running when frozen."""


def two_policies(model_path: str | os.PathLike, seed: int = 37, scale: float = 0.3):
    """``(old, new)``: the HF model of ``model_path`` (fp32, eval) and a copy with seeded noise on every
    parameter, the two weight versions of the pause-mode tests."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    new = copy.deepcopy(old)
    perturb(new, seed, scale)
    return old, new


def hf_tensors(model) -> list:
    """``(HF name, tensor)`` pairs of ``model``, the stream a weight sync sends."""
    return [(n, t.detach().clone()) for n, t in model.state_dict().items()]


def full_logprobs(model, prompt: list[int], out: list[int]) -> list[float]:
    """log p(out[j] | prompt + out[:j]) of ``model`` for every output token (one forward, temperature 1)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + out])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(out)]


def in_place_logprobs(old, new, prompt: list[int], out: list[int], switch: int) -> list[float]:
    """What an engine paused ``in_place`` samples output tokens ``switch``.. with: the ``new`` weights fed
    ``out[switch-1:]`` over the KV cache the ``old`` weights computed for ``prompt + out[:switch-1]`` (token
    ``switch-1`` was sampled before the update but fed after it)."""
    import torch

    with torch.no_grad():
        cache = old(input_ids=torch.tensor([prompt + out[:switch - 1]]), use_cache=True).past_key_values
        logits = new(input_ids=torch.tensor([out[switch - 1:-1]]), past_key_values=cache,
                     use_cache=True).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[j, out[switch + j]].item() for j in range(len(out) - switch)]


async def stream_labels(url: str, key: str | None) -> tuple[list, list]:
    """Stream one ``/generate`` of ACROSS_PROMPT from the engine at ``url`` (raw SSE) and return the per-token
    versions from its chunks (:class:`hpcrl.rollout.token_versions.ChunkLabeller`) and from its finished
    answer's ``weight_versions`` spans."""
    import aiohttp

    from hpcrl.rollout.token_versions import ChunkLabeller, labels_from_spans

    body = {"input_ids": ACROSS_PROMPT, "sampling_params": ACROSS_PARAMS, "stream": True}
    labeller, last = ChunkLabeller(), None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", json=body, headers=headers) as resp:
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    last = json.loads(line[len("data:"):])
                    labeller.add(last["output_ids"], last["meta_info"]["weight_version"])
    return labeller.labels, labels_from_spans(last["meta_info"]["weight_versions"], len(last["output_ids"]))


async def generate_across_update(clients: list, mode: str, new_tensors: list, version: str,
                                 also_running: int = 0, tensor_format: str = "flattened_bucket",
                                 freeze: bool = True):
    """One :func:`hpcrl.rollout.generate.generate` of ACROSS_PROMPT per client of ``clients`` (engines or
    router; streamed with ``keep_partial``, else not) in flight across a weight sync of ``new_tensors`` as
    ``version`` with pause mode ``mode``: once the engines run them all, every engine is frozen
    (``/pause_generation`` in place, so the sync lands mid-response whatever the machine's speed), then a
    :class:`hpcrl.weights.WeightSyncer` (``tensor``, on the first client) pauses in ``mode``, updates and
    continues. Under ``abort`` each aborted sample is continued by a second call. Returns ``(results,
    metrics)``: per client ``(first, sample)`` (the first call's ``(status, response_length, token
    versions)``, the sample), and the sync's metrics. ``also_running``: more requests started by the caller
    that must be running too before the freeze. ``tensor_format``: the sync's payload
    format (real SGLang takes ``direct`` from a process where its own metadata class does not import).
    ``freeze=False``: no in-place freeze before the sync (real SGLang's ``/pause_generation`` in ``abort`` mode
    never returns on an engine frozen in place: the aborts it sends wait for the frozen scheduler), so the
    sync's own pause must come within the response's ~1 s of decoding."""
    import asyncio

    from hpcrl.data.sample import Sample
    from hpcrl.rollout.generate import generate
    from hpcrl.weights import WeightSyncer

    samples = [Sample(tokens=list(ACROSS_PROMPT)) for _ in clients]
    tasks = [asyncio.create_task(generate(c, s, dict(ACROSS_PARAMS))) for c, s in zip(clients, samples)]
    deadline = time.monotonic() + 30
    while True:
        loads = [await clients[0].request("GET", "/v1/loads", base_url=u) for u in clients[0].engine_urls]
        if sum(x["loads"][0]["num_running_reqs"] for x in loads) >= len(clients) + also_running:
            break
        assert not any(t.done() for t in tasks) and time.monotonic() < deadline, \
            "the responses did not start, or one ended at once"
        await asyncio.sleep(0.01)
    if freeze:
        await clients[0].pause("in_place")
    syncer = WeightSyncer(clients[0], "tensor", bucket_bytes=1 << 20, timeout_s=60, pause_mode=mode,
                          tensor_format=tensor_format)
    metrics = await syncer.sync(iter(new_tensors), version)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    firsts = [(s.status, s.response_length, list(s.rollout_token_versions)) for s in samples]
    if mode == "abort":
        await asyncio.gather(*(generate(c, s, dict(ACROSS_PARAMS)) for c, s in zip(clients, samples)))
    return list(zip(firsts, samples)), metrics


def check_across_update(mode: str, first, sample, old, new, old_version: int, new_version: int,
                        tol: float = 1e-3) -> int:
    """The checks of :func:`generate_across_update`'s result; returns the index of the first token of the new
    version. One response of ACROSS_PARAMS' length whose tokens' versions switch once, from ``old_version`` to
    ``new_version``, aligned with its log-probs: before the switch the old policy's, after it the new one's
    (``abort``: a second call; ``retract``: the prefix re-prefilled) or, ``in_place``, the new weights over
    the old KV cache (:func:`in_place_logprobs`), which is neither policy. ``tol``: on log-probs (~240 decoded
    tokens against one forward drift by ~1e-4 in fp32)."""
    from hpcrl.data.sample import Status

    n = ACROSS_PARAMS["max_new_tokens"]
    out = sample.tokens[len(ACROSS_PROMPT):]
    versions, lp = sample.rollout_token_versions, sample.rollout_log_probs
    assert sample.status is Status.TRUNCATED and len(out) == len(versions) == len(lp) == n
    switch = versions.index(new_version) if new_version in versions else n
    assert 0 < switch < n, versions
    assert versions == [old_version] * switch + [new_version] * (n - switch)

    def gap(a, b):
        return max(abs(x - y) for x, y in zip(a, b, strict=True))

    assert gap(lp[:switch], full_logprobs(old, ACROSS_PROMPT, out)[:switch]) < tol
    pure_new = full_logprobs(new, ACROSS_PROMPT, out)[switch:]
    if mode == "in_place":
        assert gap(lp[switch:], in_place_logprobs(old, new, ACROSS_PROMPT, out, switch)) < tol
        assert gap(lp[switch:], pure_new) > 10 * tol  # neither the old nor the new policy
    else:
        assert gap(lp[switch:], pure_new) < tol
    if mode == "abort":  # one call per version
        assert first == (Status.ABORTED, switch, [old_version] * switch)
        assert sample.weight_versions == [str(old_version), str(new_version)]
    else:  # the same request went on
        assert first[0] is Status.TRUNCATED and sample.weight_versions == [str(new_version)]
    return switch
