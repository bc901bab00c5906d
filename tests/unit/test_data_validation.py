"""Bad datasets are refused on the login node: `hpcrl validate` / `submit` / `sweep` read every row with the
loader the run uses (hpcrl.data.datasets.check_data) and print one line `config error: data.source: FILE:LINE:
problem; fix` with exit status 2, or with `data.on_bad_row: skip` say how many rows they skipped."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpcrl import cli
from hpcrl.data import datasets
from hpcrl.data.datasets import MAX_ROW_BYTES, read_jsonl

REPO = Path(__file__).resolve().parents[2]
GOOD = json.dumps({"prompt": "1+1=", "label": "2"})
FIXES = "; "  # every message ends in '; <fix>'


def write_config(tmp_path: Path, source: str, model: str, extra: str = "") -> Path:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(textwrap.dedent(f"""
        run: {{name: v, output_dir: {tmp_path / 'runs'}}}
        model: {model}
        data: {{source: {json.dumps(str(source))}, num_eval: 1}}
        sft: {{enabled: false}}
    """) + extra)
    return cfg


@pytest.fixture
def validate(tmp_path, tiny_model_dir, capsys):
    """`hpcrl validate` of a config whose data.source is the given file; returns (exit status, stderr).
    The tiny model folder exists (context 256 tokens) unless `model_exists=False` (then model.create)."""

    def run(source, *overrides, model_exists=True, extra=""):
        model = (f"{{path: {tiny_model_dir}}}" if model_exists
                 else f"{{path: {tmp_path / 'not-yet'}, create: tiny-qwen2}}")
        code = cli.main(["validate", str(write_config(tmp_path, source, model, extra)), *overrides])
        return code, capsys.readouterr().err

    return run


def lines_file(path: Path, lines: list) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def parquet_file(path: Path, table) -> Path:
    pq.write_table(table if isinstance(table, pa.Table) else pa.Table.from_pylist(table), path)
    return path


def assert_one_line(err: str, f: Path, line, problem: str, field: str = "data.source") -> None:
    """The exact shape: `config error: <field>: FILE[:LINE]: <problem ...>; <fix>` and nothing else."""
    where = f"{f}:{line}" if line is not None else f"{f}"
    assert err.count("\n") == 1 and err.endswith("\n"), err
    m = re.fullmatch(rf"config error: {re.escape(field)}: {re.escape(where)}: (.+?); (.+)\n", err)
    assert m, err
    assert m.group(1).startswith(problem), err
    assert m.group(2).strip(), err
    assert "Traceback" not in err


# (name, file contents (lines) or a builder, the bad line (None: whole file), the problem's start)
LONG = "9" * 300
JSONL_CASES = [
    ("empty file", [], None, "no rows (the file is empty or only blank lines)"),
    ("only blank lines", ["", "   ", "\t"], None, "no rows (the file is empty or only blank lines)"),
    ("bad JSON", [GOOD, '{"prompt": "1+1=", "label"'], 2, "bad JSON (Expecting ':' delimiter"),
    ("a BOM in the middle", [GOOD, "\ufeff" + GOOD], 2, "bad JSON (Unexpected UTF-8 BOM"),
    ("invalid UTF-8", [GOOD, b'{"prompt": "1+1=\xff", "label": "2"}'], 2, "not UTF-8 (byte 0xff at column 17)"),
    ("Latin-1 text", [GOOD, '{"prompt": "caf\u00e9", "label": "2"}'.encode("latin-1")], 2,
     "not UTF-8 (byte 0xe9 at column 16)"),
    ("a JSON array on one line", [json.dumps([{"prompt": "1+1=", "label": "2"}])], 1,
     "row is a JSON list, not an object"),
    ("a JSON array over lines", ["[", GOOD + ",", GOOD, "]"], 1, "bad JSON (Expecting value"),
    ("a JSON string", [GOOD, '"1+1="'], 2, "row is a JSON str, not an object"),
    ("missing prompt", [GOOD, json.dumps({"question": "1+1=", "label": "2"})], 2,
     "no prompt key 'prompt' (keys: label, question)"),
    ("missing label", [GOOD, json.dumps({"prompt": "1+1="})], 2, "no label key 'label' (keys: prompt)"),
    ("non-string prompt", [GOOD, json.dumps({"prompt": 12, "label": "2"})], 2,
     "prompt 'prompt' is a int, not a string"),
    ("NaN prompt", [GOOD, '{"prompt": NaN, "label": "2"}'], 2, "prompt 'prompt' is a float"),
    ("empty prompt", [GOOD, json.dumps({"prompt": "  ", "label": "2"})], 2, "prompt 'prompt' is empty"),
    ("chat message without role", [GOOD, json.dumps({"prompt": [{"content": "hi"}], "label": "2"})], 2,
     "prompt 'prompt' is a list, not a string"),
    ("null label", [GOOD, json.dumps({"prompt": "1+1=", "label": None})], 2, "label 'label' is null"),
    ("object label", [GOOD, json.dumps({"prompt": "1+1=", "label": {"a": 2}})], 2,
     "label 'label' is a dict, not a string or number"),
    ("boolean label", [GOOD, json.dumps({"prompt": "1+1=", "label": True})], 2, "label 'label' is a bool"),
    ("a 10 MB line", [GOOD, json.dumps({"prompt": "x" * (10 * 2**20), "label": "2"}), GOOD], 2,
     "line is 10.0 MiB, over the 4 MiB limit of a row"),
    ("a prompt longer than the context", [GOOD, json.dumps({"prompt": LONG, "label": "2"})], 2,
     "prompt is 300 tokens, not less than the model's context of 256 tokens"),
    ("gzip-compressed JSONL", [gzip.compress(GOOD.encode())], 1, "not UTF-8 (byte 0x8b at column 2)"),
]


@pytest.mark.parametrize("name,lines,line,problem", JSONL_CASES, ids=[c[0] for c in JSONL_CASES])
def test_malformed_jsonl_is_one_config_error_line(validate, tmp_path, name, lines, line, problem):
    f = lines_file(tmp_path / "bad.jsonl", lines)
    code, err = validate(f)
    assert code == 2
    assert_one_line(err, f, line, problem)


PARQUET_CASES = [
    ("prompt column of integers", [{"prompt": 1, "label": "2"}, {"prompt": 2, "label": "3"}], 1,
     "prompt 'prompt' is a int, not a string"),
    ("label column with a null", [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": None}], 2,
     "label 'label' is null"),
    ("label column of lists", [{"prompt": "1+1=", "label": [2]}, {"prompt": "2+2=", "label": [4]}], 1,
     "label 'label' is a list"),
    ("no prompt column", [{"question": "1+1=", "label": "2"}], 1, "no prompt key 'prompt'"),
    ("no rows", pa.table({"prompt": pa.array([], pa.string()), "label": pa.array([], pa.string())}), None,
     "no rows"),
]


@pytest.mark.parametrize("name,rows,line,problem", PARQUET_CASES, ids=[c[0] for c in PARQUET_CASES])
def test_malformed_parquet_is_one_config_error_line(validate, tmp_path, name, rows, line, problem):
    f = parquet_file(tmp_path / "bad.parquet", rows)
    code, err = validate(f)
    assert code == 2
    assert_one_line(err, f, line, problem)


def test_truncated_and_fake_parquet(validate, tmp_path):
    good = parquet_file(tmp_path / "good.parquet", [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(50)])
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[:-40])
    code, err = validate(cut)
    assert code == 2
    assert_one_line(err, cut, None, "not a readable Parquet file")
    fake = lines_file(tmp_path / "fake.parquet", [GOOD, GOOD])  # JSONL named .parquet
    code, err = validate(fake)
    assert code == 2
    assert_one_line(err, fake, None, "not a readable Parquet file")
    assert validate(good)[0] == 0


def test_directory_and_missing_file(validate, tmp_path):
    d = tmp_path / "data.jsonl"
    d.mkdir()
    code, err = validate(d)
    assert code == 2 and err == (f"config error: data.source={str(d)!r}: is a directory, not a data file; check "
                                 "the path (relative paths are relative to the working directory)\n")
    code, err = validate(tmp_path / "nope.jsonl")
    assert code == 2 and "no such data file" in err and err.count("\n") == 1


def test_bad_eval_file_names_eval_source(validate, tmp_path):
    train = lines_file(tmp_path / "train.jsonl", [GOOD] * 3)
    ev = lines_file(tmp_path / "eval.jsonl", [GOOD, "{oops"])
    code, err = validate(train, f"data.eval_source={ev}")
    assert code == 2
    assert_one_line(err, ev, 2, "bad JSON", field="data.eval_source")


def test_too_few_rows_to_hold_out_eval(validate, tmp_path):
    f = lines_file(tmp_path / "two.jsonl", [GOOD, GOOD])
    code, err = validate(f, "data.num_eval=2")
    assert code == 2
    assert_one_line(err, f, None, "2 rows cannot hold out data.num_eval=2 eval rows")


def test_accepted_bom_crlf_and_blank_lines(validate, tmp_path):
    f = tmp_path / "ok.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n\r\n" + GOOD.encode() + b"\r\n")
    code, err = validate(f)
    assert code == 0, err
    assert [i["prompt"] for i in read_jsonl(f)] == ["1+1=", "1+1="]  # the BOM is not part of the first key


def test_label_not_needed_by_a_reward_plugin(validate, tmp_path):
    f = lines_file(tmp_path / "nolabel.jsonl", [json.dumps({"prompt": "1+1="})] * 3)
    assert validate(f)[0] == 2
    code, err = validate(f, "rollout.reward_function=hpcrl.rewards.verifiers.exact_match")
    assert code == 0, err


def test_skip_reports_the_count_and_the_first(validate, tmp_path):
    f = lines_file(tmp_path / "some.jsonl", [GOOD, "{bad", GOOD, json.dumps({"prompt": 3, "label": "1"}),
                                             json.dumps({"prompt": "1+1="}), GOOD])
    code, err = validate(f, "data.on_bad_row=skip")
    assert code == 0, err
    note = [x for x in err.splitlines() if x.startswith("data.source:")]
    assert note == [f"data.source: skipped 3 bad rows of {f} (6 rows; first: {f}:2: bad JSON (Expecting "
                    "property name enclosed in double quotes at column 2))"]
    all_bad = lines_file(tmp_path / "allbad.jsonl", ["{bad", "[1]"])
    code, err = validate(all_bad, "data.on_bad_row=skip")
    assert code == 2
    assert_one_line(err, all_bad, None, "no usable rows (2 rows, 2 malformed)")


def test_prompt_length_is_checked_at_start_when_the_model_does_not_exist(validate, tmp_path):
    f = lines_file(tmp_path / "long.jsonl", [GOOD, json.dumps({"prompt": LONG, "label": "2"}), GOOD])
    code, err = validate(f, model_exists=False)
    assert code == 0, err
    assert (f"data.source: prompt lengths not checked against the model's context: {tmp_path / 'not-yet'} does "
            "not exist yet (they are checked at the start of the run)") in err
    # ... and at the start the same loader refuses it (the model exists by then)
    from hpcrl.validate import load_and_check

    cfg = load_and_check(write_config(tmp_path, f, f"{{path: {tmp_path / 'm'}, create: tiny-qwen2}}"))
    from hpcrl.models.hf import ensure_model

    ensure_model(cfg.model, seed=0)
    with pytest.raises(datasets.DataError, match=r":2: prompt is 300 tokens"):
        datasets.load_datasets(cfg)


def test_no_check_files_reads_no_rows(validate, tmp_path):
    f = lines_file(tmp_path / "bad.jsonl", [GOOD, "{bad"])
    assert validate(f, model_exists=True)[0] == 2
    code = cli.main(["validate", str(tmp_path / "run.yaml"), "--no-check-files"])
    assert code == 0


def test_submit_and_sweep_refuse_before_writing_anything(tmp_path, tiny_model_dir, capsys):
    f = lines_file(tmp_path / "bad.jsonl", [GOOD, GOOD, "{bad"])
    cfg = write_config(tmp_path, f, f"{{path: {tiny_model_dir}}}")
    assert cli.main(["submit", str(cfg), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert_one_line(err, f, 3, "bad JSON")
    sweep = write_config(tmp_path, f, f"{{path: {tiny_model_dir}}}",
                         "sweep: {grid: {train.lr: [1.0e-4, 2.0e-4]}}\n")
    assert cli.main(["sweep", str(sweep), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert_one_line(err, f, 3, "bad JSON")  # the base's error, once, not one per point
    assert not (tmp_path / "runs").exists()


def test_cli_exit_status_and_no_traceback(tmp_path):
    f = lines_file(tmp_path / "bad.jsonl", [GOOD, '{"prompt": "1+1=" "label": "2"}'])
    cfg = write_config(tmp_path, f, f"{{path: {tmp_path / 'm'}, create: tiny-qwen2}}")
    out = subprocess.run([sys.executable, "-m", "hpcrl", "validate", str(cfg)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert_one_line(out.stderr, f, 2, "bad JSON (Expecting ',' delimiter at column 19)")


def _unprivileged(cmd: list[str]) -> list[str]:
    """`cmd` as user nobody (runuser) when nobody can run this interpreter; where it cannot (a Python under
    /root, mode 0700, as on the development machines), as uid 0 without any capability (setpriv), which is
    refused a file of another user with mode 0600 just the same."""
    if shutil.which("runuser") is None:
        pytest.skip("runuser is missing: cannot run hpcrl as an unprivileged user")
    probe = subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-c", "import yaml"],
                           capture_output=True, timeout=60)
    if probe.returncode == 0:
        return ["runuser", "-u", "nobody", "--", *cmd]
    if shutil.which("setpriv") is None:
        pytest.skip(f"nobody cannot run {sys.executable} and setpriv is missing")
    return ["setpriv", "--bounding-set=-all", "--inh-caps=-all", *cmd]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand the file to another user")
def test_unreadable_file_as_an_unprivileged_user():
    d = Path(tempfile.mkdtemp(prefix="hpcrl-perm-"))
    try:
        d.chmod(0o755)
        f = lines_file(d / "secret.jsonl", [GOOD] * 3)
        f.chmod(0o600)
        os.chown(f, 0, 0)
        cfg = write_config(d, f, f"{{path: {d / 'm'}, create: tiny-qwen2}}")
        cmd = _unprivileged([sys.executable, "-m", "hpcrl", "validate", str(cfg)])
        if cmd[0] == "setpriv":
            os.chown(f, 65534, 65534)  # nobody's: uid 0 without CAP_DAC_OVERRIDE is refused it
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=d, timeout=120,
                             env=dict(os.environ, PYTHONPATH=str(REPO), HOME=str(d)))
        assert out.returncode == 2, out.stderr
        assert_one_line(out.stderr, f, None, "cannot read the file (Permission denied)")
        assert "chmod" in out.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_max_row_bytes_is_what_the_reader_enforces(tmp_path):
    ok = lines_file(tmp_path / "edge.jsonl", [json.dumps({"prompt": "x" * (MAX_ROW_BYTES - 40), "label": "1"})])
    assert len(read_jsonl(ok)) == 1
