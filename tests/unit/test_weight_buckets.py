"""Bucketing of the weight-sync stream (hpcrl.weights.buckets) and the small pure helpers of hpcrl.weights."""

from __future__ import annotations

import pytest
import torch

from hpcrl.weights.buckets import iter_buckets, tensor_nbytes


def _stream(sizes, dtype=torch.float32):
    return [(f"t{i}", torch.zeros(n, dtype=dtype)) for i, n in enumerate(sizes)]


def _layout(buckets):
    return [[name for name, _ in b.tensors] for b in buckets]


def test_tensor_nbytes_counts_elements_times_size():
    assert tensor_nbytes(torch.zeros(3, 5)) == 60
    assert tensor_nbytes(torch.zeros(7, dtype=torch.bfloat16)) == 14
    assert tensor_nbytes(torch.zeros(10, 10)[:, :2]) == 80  # a view: its own elements only


def test_greedy_packing_respects_the_limit_and_keeps_order():
    stream = _stream([4, 4, 4, 8, 2, 2, 2])  # bytes 16 16 16 32 8 8 8
    buckets = list(iter_buckets(stream, bucket_bytes=40))
    assert _layout(buckets) == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5", "t6"]]
    assert [b.nbytes for b in buckets] == [32, 16, 40, 16]
    assert all(b.nbytes <= 40 for b in buckets)
    assert [b.index for b in buckets] == [0, 1, 2, 3]
    assert [b.is_last for b in buckets] == [False, False, False, True]
    flat = [name for b in buckets for name, _ in b.tensors]
    assert flat == [name for name, _ in stream]


def test_exact_fit_shares_a_bucket():
    buckets = list(iter_buckets(_stream([2, 2, 2]), bucket_bytes=16))
    assert _layout(buckets) == [["t0", "t1"], ["t2"]]


def test_a_tensor_larger_than_a_bucket_goes_alone():
    buckets = list(iter_buckets(_stream([1, 100, 1, 1, 100]), bucket_bytes=12))
    assert _layout(buckets) == [["t0"], ["t1"], ["t2", "t3"], ["t4"]]
    assert buckets[1].nbytes == 400 and buckets[-1].is_last and not buckets[1].is_last


def test_single_tensor_and_empty_stream():
    (only,) = iter_buckets(_stream([5]), bucket_bytes=1)
    assert only.is_last and only.index == 0 and len(only) == 1
    assert list(iter_buckets([], bucket_bytes=10)) == []


def test_mixed_dtypes_are_counted_in_bytes():
    stream = [("a", torch.zeros(4, dtype=torch.bfloat16)), ("b", torch.zeros(2)), ("c", torch.zeros(1))]
    buckets = list(iter_buckets(stream, bucket_bytes=16))  # 8 + 8 = 16 fits, then 4
    assert _layout(buckets) == [["a", "b"], ["c"]]


def test_stream_is_consumed_lazily():
    pulled = []

    def gen():
        for i in range(6):
            pulled.append(i)
            yield f"t{i}", torch.zeros(4)  # 16 bytes

    it = iter_buckets(gen(), bucket_bytes=32)
    first = next(it)
    assert _layout([first]) == [["t0", "t1"]]
    assert pulled == [0, 1, 2]  # one tensor of look-ahead, no more


def test_bad_arguments():
    with pytest.raises(ValueError):
        list(iter_buckets(_stream([1]), bucket_bytes=0))
    with pytest.raises(TypeError):
        list(iter_buckets([("a", [1, 2])], bucket_bytes=10))
    with pytest.raises(TypeError):
        list(iter_buckets([torch.zeros(2)], bucket_bytes=10))


def test_rank_offsets_and_folder_names():
    from hpcrl.weights.disk import FOLDER_RE, folder_name
    from hpcrl.weights.distributed import rank_offsets

    assert rank_offsets([1]) == [1]
    assert rank_offsets([2, 1, 4]) == [1, 3, 4]
    assert folder_name(7) == "weight_v000007" and FOLDER_RE.match(folder_name(7))
    assert not FOLDER_RE.match("weight_v7") and not FOLDER_RE.match("weights")


def test_remove_old_folders_touches_only_weight_folders(tmp_path):
    from hpcrl.weights.disk import remove_old_folders

    for name in ("weight_v000001", "weight_v000002", ".weight_v000001.tmp-12", "weight_v000003", "other",
                 "weight_vx"):
        (tmp_path / name).mkdir()
    removed = remove_old_folders(tmp_path, keep="weight_v000003")
    assert sorted(removed) == [".weight_v000001.tmp-12", "weight_v000001", "weight_v000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "weight_v000003", "weight_vx"]


def test_write_hf_folder_is_a_loadable_sharded_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from hpcrl.weights.disk import write_hf_folder

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"old")
    tensors = {f"w{i}": torch.randn(8) for i in range(5)}  # 32 bytes each
    stats = write_hf_folder(tensors.items(), tmp_path / "out", bucket_bytes=64, hf_checkpoint=src)
    assert stats["buckets"] == 3 and stats["tensors"] == 5 and stats["bytes"] == 160
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    loaded = {}
    for f in out.glob("*.safetensors"):
        loaded.update(load_file(str(f)))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items()) and len(loaded) == 5
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary folder left
    with pytest.raises(ValueError):
        write_hf_folder([], tmp_path / "empty", bucket_bytes=64)
    assert not (tmp_path / "empty").exists() and not list(tmp_path.glob(".empty*"))


def test_weight_sync_error_names_url_endpoint_and_message():
    from hpcrl.weights import WeightSyncError

    e = WeightSyncError("http://a:1", "/update_weights_from_tensor", "unknown parameter 'x'",
                        [("http://a:1", "unknown parameter 'x'"), ("http://b:2", "timed out")])
    text = str(e)
    assert "http://a:1" in text and "/update_weights_from_tensor" in text and "unknown parameter 'x'" in text
    assert "http://b:2: timed out" in text and e.url == "http://a:1"


def test_package_import_is_light():
    import subprocess
    import sys

    code = ("import sys, hpcrl.weights; "
            "print(any(m in sys.modules for m in ('megatron.core', 'aiohttp', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_staging_arena_stages_buckets_in_reused_shared_memory():
    """:class:`hpcrl.engine.serialize.StagingArena`: mixed dtypes, odd sizes and non-contiguous tensors come
    back bitwise in both payload formats (and cast when asked); each tensor starts on a 64-byte boundary; the
    same shared memory serves every bucket that fits and grows for one that does not."""
    import torch

    from hpcrl.engine.serialize import (ALIGN_BYTES, StagingArena, deserialize_flattened_bucket,
                                        deserialize_named_tensors, serialize_views)

    tensors = [("a", torch.randn(3, 5).to(torch.bfloat16)), ("b", torch.randn(7, 4).t()),  # non-contiguous
               ("c", torch.arange(5)), ("d", torch.randn(1))]
    arena = StagingArena()
    views, flat, metadata = arena.pack(tensors)
    assert arena.buffer.is_shared() and all(m.start_idx % ALIGN_BYTES == 0 for m in metadata)
    for got in (deserialize_named_tensors(serialize_views(views)),
                deserialize_flattened_bucket(serialize_views({"flattened_tensor": flat, "metadata": metadata}))):
        assert [n for n, _ in got] == [n for n, _ in tensors]
        for (_, g), (_, t) in zip(got, tensors, strict=True):
            assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(g, t)
    first = arena.buffer.data_ptr()
    arena.pack(tensors[:2])
    assert arena.buffer.data_ptr() == first  # reused
    cast, _, _ = arena.pack([("b", tensors[1][1])], dtype=torch.bfloat16)
    assert cast[0][1].dtype == torch.bfloat16 and torch.equal(cast[0][1], tensors[1][1].to(torch.bfloat16))
    arena.pack([("big", torch.zeros(arena.buffer.numel()))])  # 4x the bytes: a larger buffer
    assert arena.buffer.numel() >= 4 * flat.numel()


def test_the_tensor_payload_format_follows_the_engines(monkeypatch):
    """Real SGLang unpickles only its own ``FlattenedTensorMetadata`` (its scheduler exits on any other class,
    issue #53): against SGLang engines a flattened bucket is sent only where SGLang's class imports in the
    trainer, and then pickled as that class, which hpcrl's CPU engine reads too; elsewhere named tensors
    (``direct``). Against the CPU engine nothing changes."""
    import sys
    import types

    from hpcrl.engine import serialize
    from hpcrl.weights.sync import tensor_format_for

    assert tensor_format_for(False) == "flattened_bucket"
    assert serialize.metadata_class() is serialize.FlattenedTensorMetadata
    monkeypatch.setitem(sys.modules, serialize.SGLANG_METADATA_MODULE, None)  # as where SGLang cannot import
    assert tensor_format_for(True) == "direct"

    # where it imports, its class is the one the metadata is made of
    fake = types.ModuleType(serialize.SGLANG_METADATA_MODULE)
    fake.FlattenedTensorMetadata = type("FlattenedTensorMetadata", (serialize.FlattenedTensorMetadata,), {})
    monkeypatch.setitem(sys.modules, serialize.SGLANG_METADATA_MODULE, fake)
    assert tensor_format_for(True) == "flattened_bucket"
    assert serialize.metadata_class() is fake.FlattenedTensorMetadata
