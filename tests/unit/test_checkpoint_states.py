"""The checkpoint manager's named statefuls, without a model: ``state.json`` keeps the layout older
checkpoints have (``rollout_id`` and ``metrics`` at the top, the data source without its groups, no
``trained``), the statefuls that own files write the same buffer file the one-call writer wrote, a buffer
written the old way loads back unchanged, and a new stateful that owns a file needs nothing from the
manager."""

from __future__ import annotations

import json
from pathlib import Path

from hpcrl.checkpoint.manager import RolloutCounter, pack_states, unpack_states
from hpcrl.data.buffer import BUFFER_FILE, TrainedRows, read_buffer, read_pending, write_buffer
from hpcrl.data.sample import Sample, Status
from hpcrl.data.source import DataSource
from hpcrl.loop_async import PendingRollout
from hpcrl.metrics import MetricsPosition


def _sample(i: int, group: int, status=Status.COMPLETED) -> Sample:
    return Sample(group_index=group, index=i, prompt=f"{i}+1=", label=str(i + 1), tokens=[1, 2, 3, 4],
                  response="4", response_length=2, loss_mask=[1, 0], rollout_log_probs=[-0.5, -1.25],
                  reward=1.0 if status is Status.COMPLETED else None, status=status, weight_versions=["3"])


ITEMS = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(6)]


def run_states(run_dir: Path) -> dict:
    """The statefuls of an async run, in the order the session hands them to the manager."""
    return {"progress": RolloutCounter(), "data_source": DataSource(ITEMS, 2, seed=3),
            "trained": TrainedRows(), "metrics": MetricsPosition(run_dir, controller=True),
            "pending": PendingRollout()}


def filled(run_dir: Path) -> dict:
    st = run_states(run_dir)
    st["progress"].rollout_id = 4
    groups = st["data_source"].get_samples(2)
    held = [_sample(30, 9, Status.ABORTED), _sample(31, 9, Status.PENDING)]
    st["data_source"].add_samples([held])
    st["trained"].extend(4, groups[0])
    st["pending"].put(5, [_sample(20, 6), _sample(21, 6)], {"rollout/reward_mean": 0.5})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (-1, 0, 4, 5)))
    return st


def test_state_json_keeps_the_old_layout_and_the_parts_make_the_old_buffer_file(tmp_path):
    st = filled(tmp_path)
    extra, writers = pack_states(st, config={"run": {"name": "x"}})
    assert set(extra) == {"rollout_id", "data_source", "metrics", "config", "pending"}
    assert extra["rollout_id"] == 4 and "buffer" not in extra["data_source"]
    assert [r["step"] for r in extra["metrics"]] == [-1, 0, 4, 5] and "groups" not in extra["pending"]
    json.dumps(extra)  # plain JSON
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for write in writers:
        write(folder)
    groups, trained = read_buffer(folder / BUFFER_FILE)
    held = st["data_source"].buffer
    assert [[s.to_dict() for s in g] for g in groups] == [[s.to_dict() for s in g] for g in held]
    assert trained.tolist() == [list(r) for r in st["trained"].rows]
    assert [s.index for g in read_pending(folder / BUFFER_FILE) for s in g] == [20, 21]

    back = run_states(tmp_path)
    for name, state in unpack_states(json.loads(json.dumps(extra)), folder, back).items():
        back[name].load_state_dict(state)
    assert back["progress"].rollout_id == 4 and back["trained"].rows == st["trained"].rows
    assert back["data_source"].state_dict() == st["data_source"].state_dict()
    assert back["pending"].rollout_id == 5 and back["pending"].metrics == st["pending"].metrics
    assert [s.to_dict() for s in back["pending"].samples] == [s.to_dict() for s in st["pending"].samples]
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in rows] == [-1, 0, 4]


def test_a_buffer_written_in_one_call_as_before_loads_unchanged(tmp_path):
    """Checkpoints saved before the statefuls wrote their own parts (one ``write_buffer`` call)."""
    st = filled(tmp_path)
    extra, _ = pack_states(st)
    write_buffer(tmp_path / BUFFER_FILE, st["data_source"].buffer, st["trained"].state_dict()["rows"],
                 pending=[st["pending"].samples])
    back = run_states(tmp_path)
    for name, state in unpack_states(extra, tmp_path, back).items():
        back[name].load_state_dict(state)
    assert back["data_source"].state_dict() == st["data_source"].state_dict()
    assert back["trained"].rows == st["trained"].rows
    assert back["pending"].take(5)[1] == {"rollout/reward_mean": 0.5}


def test_a_checkpoint_without_a_buffer_file_or_a_pending_entry_gives_fresh_parts(tmp_path):
    st = filled(tmp_path)
    extra, _ = pack_states(st)
    del extra["pending"]
    back = run_states(tmp_path)
    for name, state in unpack_states(extra, tmp_path / "none", back).items():
        back[name].load_state_dict(state)
    assert back["data_source"].buffer == [] and back["trained"].rows == []
    assert back["pending"].rollout_id is None


class Notes:
    """A stateful the manager has never heard of: a counter in state.json and a text file of its own."""

    file_keys = ("lines",)

    def __init__(self) -> None:
        self.count, self.lines = 0, []

    def state_dict(self) -> dict:
        return {"count": self.count, "lines": list(self.lines)}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.lines = state["count"], state["lines"]

    def save_files(self, state: dict, folder: Path) -> None:
        (Path(folder) / "notes.txt").write_text("\n".join(state["lines"]))

    def load_files(self, state: dict, folder: Path) -> dict:
        return {**state, "lines": (Path(folder) / "notes.txt").read_text().split("\n")}


def test_a_new_file_owning_stateful_needs_nothing_from_the_manager(tmp_path):
    notes = Notes()
    notes.count, notes.lines = 2, ["a", "b"]
    extra, writers = pack_states({"progress": RolloutCounter(), "notes": notes})
    assert extra == {"rollout_id": -1, "notes": {"count": 2}, "config": {}}
    for write in writers:
        write(tmp_path)
    back = {"progress": RolloutCounter(), "notes": Notes()}
    for name, state in unpack_states(extra, tmp_path, back).items():
        back[name].load_state_dict(state)
    assert (back["notes"].count, back["notes"].lines) == (2, ["a", "b"])
