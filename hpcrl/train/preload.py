"""What every trainer process of a local multi-process run imports, imported once in the launcher's fork server
(:func:`hpcrl.launch_local.worker_context`): each trainer process is then forked from it with these modules
loaded instead of importing them itself.

Importing torch, megatron-core (prepared for the CPU: :func:`hpcrl.train.parallel.prepare_megatron`),
transformers' model code and hpcrl's trainer costs ~5 CPU-seconds per process on a 2-core CPU machine; a run of
``train.nprocs`` processes paid it ``nprocs`` times (issue #52: a 2-rank tiny run's start was half its CPU).
Nothing here runs a tensor operation or starts a thread (the forked processes set their own thread counts), and
it is imported only where no GPU is present (CUDA must not be initialised before a fork). Importing it has no
other effect; a module that fails to import here is imported (and fails) in the trainer process instead.
"""

from __future__ import annotations

from hpcrl.run_setup import quiet_import_warnings

quiet_import_warnings()

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

from hpcrl.train.parallel import prepare_megatron  # noqa: E402

prepare_megatron()

import h5py  # noqa: E402,F401 - the data buffer's file
import megatron.core.dist_checkpointing  # noqa: E402,F401 - checkpoints
import megatron.core.models.gpt  # noqa: E402,F401 - the model and its layer specs
import transformers.modeling_utils  # noqa: E402,F401
from transformers import AutoConfig, AutoTokenizer  # noqa: E402,F401

import hpcrl.checkpoint.manager  # noqa: E402,F401
import hpcrl.data.buffer  # noqa: E402,F401
import hpcrl.data.datasets  # noqa: E402,F401
import hpcrl.engine.server  # noqa: E402,F401 - the controller's engine fork server (hpcrl.fork_server)
import hpcrl.loop  # noqa: E402,F401
import hpcrl.metrics  # noqa: E402,F401
import hpcrl.preempt  # noqa: E402,F401
import hpcrl.rollout.client  # noqa: E402,F401
import hpcrl.rollout.evaluate  # noqa: E402,F401
import hpcrl.rollout.rollout  # noqa: E402,F401
import hpcrl.tracking  # noqa: E402,F401
import hpcrl.train.packed_attention  # noqa: E402,F401
import hpcrl.weights.tensor  # noqa: E402,F401
import hpcrl.loop_async  # noqa: E402,F401
import hpcrl.rollout.manager  # noqa: E402,F401
import hpcrl.sft  # noqa: E402,F401
import hpcrl.train.actor  # noqa: E402,F401
import hpcrl.train.bridge  # noqa: E402,F401
import hpcrl.train.model  # noqa: E402,F401
import hpcrl.weights.sync  # noqa: E402,F401
