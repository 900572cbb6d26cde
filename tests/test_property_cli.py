"""Property-based tests over the CLI's argument space: a bad option value gives exit code 2 and
one `error: ...` line (or click's usage error) — never a traceback — and leaves the files in
the folder exactly as they were. Only rejection paths run (no training, no benchmark)."""

from __future__ import annotations

import sys

import hypothesis
from hypothesis import given, settings
from hypothesis import strategies as st

from convolab import cli

BOUNDED = settings(max_examples=25, deadline=None, database=None,
                   suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])


def run_main(args: list[str], capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["convolab", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.err


def snapshot(folder) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_one_error(code: int, err: str) -> None:
    assert "Traceback" not in err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    # typer/click report a value that does not parse as a usage error panel of their own
    usage_error = err.startswith("Usage:") and "Error" in err
    assert len(lines) == 1 or usage_error, err


BAD_NUMBERS = st.sampled_from(["0", "-1", "-7", "nan", "inf", "-inf", "", "1e999", "abc",
                               "99999999999999999999", "1.5"])


def test_train_rejects_bad_hyper_parameters(tmp_path, seed, capsys, monkeypatch) -> None:
    (tmp_path / "keep.json").write_text("{}")
    before = snapshot(tmp_path)

    @BOUNDED
    @given(option=st.sampled_from(["--epochs", "--batch"]), value=BAD_NUMBERS)
    def prop(option: str, value: str) -> None:
        code, err = run_main(["train", "--device", "cpu", option, value,
                              "--out", str(tmp_path / "keep.safetensors")], capsys, monkeypatch)
        assert_one_error(code, err)
        assert snapshot(tmp_path) == before

    hypothesis.seed(seed)(prop)()


def test_classify_rejects_bad_options(tmp_path, seed, capsys, monkeypatch) -> None:
    before = snapshot(tmp_path)

    @BOUNDED
    @given(args=st.one_of(
        BAD_NUMBERS.filter(lambda v: v != "1.5").map(lambda v: ["--batch", v]),
        st.sampled_from(["", "tpu", "GPU", "cuda:0"]).map(lambda v: ["--device", v]),
        st.sampled_from(["", "nosuch", "cpu-ref:k=1", "basic"]).map(lambda v: ["--impl", v]),
        st.sampled_from(["", "fp8", "EXACT"]).map(lambda v: ["--mode", v]),
    ))
    def prop(args: list[str]) -> None:
        dev = [] if "--device" in args else ["--device", "cpu"]
        code, err = run_main(["classify", *dev, *args, "--data-dir", str(tmp_path / "missing")],
                             capsys, monkeypatch)
        assert_one_error(code, err)
        assert snapshot(tmp_path) == before

    hypothesis.seed(seed)(prop)()


def test_bench_rejects_bad_shapes_and_impls(tmp_path, seed, capsys, monkeypatch) -> None:
    before = snapshot(tmp_path)

    @BOUNDED
    @given(args=st.one_of(
        st.sampled_from(["", "1,2,3", "a,b,c,d,e,f,g", "1,1,5,5,1,7,1", "0,1,5,5,1,3,1",
                         "1,1,5,5,1,3,-1", "1,1,5,5,1,3,1,2,9"]).map(lambda v: ["--shape", v]),
        st.sampled_from(["nosuch", "cpu-ref:", "cpu-ref:k", "cpu-ref:zz=1", ":"]).map(
            lambda v: ["--impl", v]),
        st.sampled_from([str(tmp_path / "missing.toml"), str(tmp_path)]).map(
            lambda v: ["--plan", v]),
    ))
    def prop(args: list[str]) -> None:
        code, err = run_main(["bench", "--batch", "1", "--reps", "1", *args,
                              "--out", str(tmp_path / "results")], capsys, monkeypatch)
        assert_one_error(code, err)
        assert snapshot(tmp_path) == before

    hypothesis.seed(seed)(prop)()
