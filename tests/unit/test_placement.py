"""hpcrl.placement: CPU lists, the split of a disaggregated local run, and the one-line errors (issue #11 point 3).
The processes' real affinity is checked on a running async run in tests/integration/test_async_local.py."""

from __future__ import annotations

import os

import pytest

from hpcrl.config import ConfigError
from hpcrl.placement import CpuSets, format_cpu_list, local_cpu_sets, parse_cpu_list, pin, unpin


@pytest.mark.parametrize("spec,cpus", [("0", [0]), (3, [3]), ("0-3,8", [0, 1, 2, 3, 8]), ("5,1-2,2", [1, 2, 5]),
                                       (" 4 - 5 ", [4, 5])])
def test_parse_and_format_cpu_lists(spec, cpus):
    assert parse_cpu_list(spec) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus
    assert format_cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize("spec,problem", [("", "empty entry"), ("1,,2", "empty entry"), ("3-1", "not a range"),
                                          ("a", "not a CPU number"), (-1, "negative"), (True, "not a CPU list")])
def test_bad_cpu_lists(spec, problem):
    with pytest.raises(ValueError, match=problem):
        parse_cpu_list(spec)


def test_even_split_and_one_side_given():
    assert local_cpu_sets(None, None, [0, 1]) == CpuSets((0,), (1,))
    assert local_cpu_sets(None, None, [0, 1, 2]) == CpuSets((0, 1), (2,))
    assert local_cpu_sets("0-5", None, list(range(8))) == CpuSets(tuple(range(6)), (6, 7))
    assert local_cpu_sets(None, "0", [0, 1, 2, 3]) == CpuSets((1, 2, 3), (0,))
    sets = local_cpu_sets("0", "1-7", list(range(8)))
    assert [sets.engine(i, 3) for i in range(3)] == [(1, 2), (3, 4), (5, 6, 7)]  # each engine its share
    assert [sets.engine(i, 9) for i in range(2)] == [sets.rollout] * 2  # fewer CPUs than engines: shared


@pytest.mark.parametrize("train,rollout,avail,field,problem", [
    ("0-2", None, [0, 1], "train.cpus", "CPUs 2 are not available to this run (it may use 0-1)"),
    (None, None, [0], "rollout.cpus", "needs at least 2 CPUs"),
    ("0-1", None, [0, 1], "rollout.cpus", "leaves no CPU"),
    ("0-1", "1", [0, 1], "rollout.cpus", "overlaps train.cpus='0-1' on CPUs 1"),
    ("x", None, [0, 1], "train.cpus", "'x' is not a CPU number"),
])
def test_refusals_are_one_line_config_errors(train, rollout, avail, field, problem):
    with pytest.raises(ConfigError) as e:
        local_cpu_sets(train, rollout, avail)
    assert e.value.field == field and problem in str(e.value) and "\n" not in str(e.value)


def test_hpcrl_run_refuses_cpus_the_machine_does_not_give_before_starting(tmp_path, capsys):
    """``hpcrl run`` checks the CPU sets against this process's CPUs first: one line, exit 2, no run folder."""
    from hpcrl.cli import main

    too_many = max(os.sched_getaffinity(0)) + 1
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{create: tiny-qwen2, path: {tmp_path}/m}}\nrun: {{output_dir: {tmp_path}/runs, "
                   f"placement: disaggregate}}\nrollout: {{cpus: {too_many}}}\n")
    assert main(["run", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"config error: rollout.cpus={too_many}: CPUs {too_many} are not available to this run (it may "
                   f"use {format_cpu_list(sorted(os.sched_getaffinity(0)))}); pick CPUs from that list"), err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "m").exists()


def test_pin_sets_affinity_and_threads_and_unpin_restores():
    import torch

    before_cpus, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    one = min(before_cpus)
    saved = pin([one])
    try:
        assert os.sched_getaffinity(0) == {one} and torch.get_num_threads() == 1
    finally:
        unpin(saved)
    assert os.sched_getaffinity(0) == before_cpus and torch.get_num_threads() == before_threads
