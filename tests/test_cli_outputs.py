"""Issue 13, the command line: output paths checked before the work, nothing half-written,
every printed figure naming its images, bad numbers refused up front, honest messages."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from convolab import classify, cli, data, info, models, outputs, train, verify, weights
from convolab.errors import ConvolabError, WeightsError

runner = CliRunner()


def refused(args: list[str], needle: str) -> None:
    """The command stops with one ConvolabError naming `needle` (cli.main prints it as one
    `error:` line, exit 2), or with typer's own usage error (exit 2)."""
    result = runner.invoke(cli.app, args)
    if isinstance(result.exception, ConvolabError):
        assert needle in str(result.exception), str(result.exception)
    else:
        assert result.exit_code == 2, (result.output, result.exception)
        assert needle in result.output, result.output


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refusals must come before any data is loaded or weights are read."""
    def forbidden(*args: object, **kw: object) -> None:
        raise AssertionError("loaded data or weights before checking the options")

    monkeypatch.setattr(data, "load_images", forbidden)
    monkeypatch.setattr(models, "load", forbidden)


# Item 1 and 5: output paths -------------------------------------------------------------

@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda d: d / "X.json", "sidecar"),                    # sidecar == weights file
        (lambda d: d, "is a directory"),                        # a directory
        (lambda d: d / "file.txt" / "w.safetensors", "is a file, not a folder"),
        (lambda d: d / "missing" / "w.safetensors", "does not exist"),
        (lambda d: models.weights_path("ece408"), "--force"),   # the shipped weights
    ],
)
def test_train_refuses_bad_out_before_loading(tmp_path: Path, no_loading: None, make,
                                              needle: str) -> None:
    (tmp_path / "file.txt").write_text("x")
    refused(["train", "--out", str(make(tmp_path)), "--limit", "10"], needle)


def test_train_refuses_empty_out(no_loading: None) -> None:
    refused(["train", "--out", ""], "is a directory")


def test_sidecar_never_replaces_an_unrelated_file(tmp_path: Path, no_loading: None) -> None:
    notes = tmp_path / "w.json"
    notes.write_text('{"mine": true}')
    refused(["train", "--out", str(tmp_path / "w.safetensors")], "--force")
    assert notes.read_text() == '{"mine": true}'
    # A sidecar convolab train wrote may be replaced; anything may with --force.
    assert train.plan_files(tmp_path / "w.safetensors", force=True)[1] == notes
    notes.write_text(json.dumps({"command": "convolab train --model ece408"}))
    assert train.plan_files(tmp_path / "w.safetensors")[1] == notes


def test_shipped_weights_need_force_and_default_out_is_a_user_path() -> None:
    shipped = models.weights_path("ece408")
    with pytest.raises(ConvolabError, match="--force"):
        train.plan_files(shipped)
    assert train.plan_files(shipped, force=True)[0] == shipped  # checked, not written
    default = train.default_out("ece408")
    assert not default.is_absolute() and default.resolve().parent == Path.cwd().resolve()


def test_no_weights_hint_points_to_a_user_path(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setattr(models, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(WeightsError) as err:
        models.load("ece408")
    assert "--out" not in str(err.value)  # the hint once led to the shipped weights' path
    assert "--weights ./ece408.safetensors" in str(err.value)


def test_plan_outputs_refuses_two_outputs_on_one_file(tmp_path: Path) -> None:
    with pytest.raises(ConvolabError, match="same file"):
        outputs.plan_outputs({"--out": tmp_path / "a.json", "--json": tmp_path / "." / "a.json"})


@pytest.mark.parametrize("bad", ["", "dir", "file/x.json", "none/x.json"])
def test_classify_json_path_checked_before_loading(tmp_path: Path, no_loading: None,
                                                   bad: str) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    path = tmp_path / bad if bad else Path("")
    with pytest.raises(ConvolabError, match="--json"):
        classify.main(model="ece408", batch=5, impl=None, device="cpu", weights=None,
                      data_dir=None, per_layer=False, mode=None, throughput=None,
                      self_test=False, json_out=path)


def test_bench_out_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConvolabError, match="is a file"):
        outputs.check_dir(tmp_path / "f" / "results", "--out")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConvolabError, match="not writable"):
            outputs.check_file(ro / "w.safetensors", "--out")
    finally:
        ro.chmod(0o700)


def test_failed_write_leaves_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "results.json"
    target.write_text("old")

    def broken(fh) -> None:
        fh.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(ConvolabError, match="results.json"):
        outputs.write_atomic(target, broken)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


# Item 11: file modes -----------------------------------------------------------------------

@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_written_files_get_the_umask_mode(tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        w = weights.save(models.build("ece408"), tmp_path / "w.safetensors")
        j = outputs.write_json(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(old)
    for path in (w, j):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask, path


# Item 3: non-finite numbers ----------------------------------------------------------------

@pytest.mark.parametrize("lr", ["nan", "inf", "-inf", "0", "-1"])
def test_non_finite_or_non_positive_lr_refused(no_loading: None, lr: str) -> None:
    refused(["train", "--lr", lr], "--lr")


def test_sidecar_json_refuses_nan(tmp_path: Path) -> None:
    with pytest.raises(ConvolabError, match="r.json"):
        outputs.write_json(tmp_path / "r.json", {"lr": float("nan")})
    assert not (tmp_path / "r.json").exists()


def test_weights_with_nan_or_inf_are_refused(tmp_path: Path) -> None:
    net = models.build("ece408")
    path = weights.save(net, tmp_path / "w.safetensors")
    for bad in (np.nan, np.inf):
        tensors, meta = weights.read(path)
        tensors["f6.weight"][0, 0] = bad
        from safetensors.numpy import save_file

        save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=meta)
        with pytest.raises(WeightsError, match="f6.weight holds NaN or Inf"):
            models.load("ece408", tmp_path / "bad.safetensors")
    net.set_param("c1.bias", np.full_like(net.params()["c1.bias"], np.nan))
    with pytest.raises(WeightsError, match="c1.bias"):
        weights.save(net, tmp_path / "nan.safetensors")
    assert not (tmp_path / "nan.safetensors").exists()


def test_diverging_training_stops_and_writes_nothing(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.zeros((8, 1, 86, 86), np.float32)
    y = np.zeros(8, np.int64)
    monkeypatch.setattr(data, "load_images", lambda *a, **k: (x, y))
    real = train.CrossEntropyLoss

    class Diverging(real):  # type: ignore[misc, valid-type]
        def __call__(self, logits, labels):
            loss, grad = super().__call__(logits, labels)
            return float("nan"), grad

    monkeypatch.setattr(train, "CrossEntropyLoss", Diverging)
    out = tmp_path / "w.safetensors"
    with pytest.raises(ConvolabError, match="diverged"):
        train.main(epochs=1, batch=4, out=out, quiet=True)
    assert list(tmp_path.iterdir()) == []


# Items 6 and 10: limits and up-front refusals -----------------------------------------------

@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train", "--batch", "100000"], "4096"),
        (["train", "--batch", "4097"], "4096"),
        (["train", "--seed", "-1"], "--seed"),
        (["train", "--limit", "0"], "--limit"),
        (["train", "--optimizer", "rmsprop"], "--optimizer"),
        (["classify", "-d", "cpu", "--throughput", "1000000000"], "10,000,000"),
        (["classify", "-d", "cpu", "--throughput", "0"], "--throughput"),
        (["classify", "-d", "cpu", "--throughput", "-5"], "--throughput"),
        (["classify", "-d", "cpu", "--throughput", "1e9"], "--throughput"),
        (["classify", "-d", "cpu", "--mode", "fp16"], "--mode"),
        (["classify", "-d", "cpu", "--mode", "exact"], "--mode"),
    ],
)
def test_refused_up_front(no_loading: None, args: list[str], needle: str) -> None:
    refused(args, needle)


@pytest.mark.parametrize("value", ["0", "-5", "10000001"])
def test_throughput_checked_before_the_device(no_loading: None, monkeypatch: pytest.MonkeyPatch,
                                              value: str) -> None:
    """A bad --throughput gets its own message even where --device gpu has no GPU to run on."""
    from convolab import backend

    monkeypatch.setattr(backend, "gpu_available", lambda: False)
    refused(["classify", "-d", "gpu", "--throughput", value], "--throughput must be between")


def test_mode_refused_with_per_layer_on_gpu() -> None:
    with pytest.raises(ConvolabError, match="--mode"):
        classify.resolve_mode("fp16", "gpu", "ece408", fused=False)
    assert classify.resolve_mode(None, "cpu", "ece408", fused=False) == "exact"


def test_help_texts_match_the_code() -> None:
    train_help = runner.invoke(cli.app, ["train", "--help"]).output
    assert "default: cpu" in train_help and "MODEL.safetensors" in train_help
    verify_help = runner.invoke(cli.app, ["verify", "--help"]).output
    assert "both" not in verify_help
    refused(["verify", "--device", "both"], "--device")


def test_verify_says_how_many_gpu_implementations_it_skipped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify, "gpu_available", lambda: False)
    skipped = verify.skipped_gpu(None, None)
    from convolab import registry

    assert skipped == len(registry.all_impls("gpu", include_reference=False)) > 0
    assert verify.skipped_gpu("cpu", None) == 0
    line = verify.summary([], skipped)
    assert f"{skipped} GPU implementations skipped" in line


def test_info_never_offers_to_download_into_a_named_folder(tmp_path: Path) -> None:
    missing = info.dataset_line(tmp_path / "missing")
    assert "no such directory" in missing and "would download" not in missing
    for name in data.FILES:
        (tmp_path / name).write_bytes(b"not gzip")
    corrupt = info.dataset_line(tmp_path)
    assert "FAILED verification" in corrupt and "not a valid gzip file" in corrupt


# Item 2: each figure names its images; throughput streams with the chosen implementation --

@pytest.mark.skipif(not models.weights_path("ece408").is_file(), reason="no shipped weights")
def test_throughput_has_its_own_accuracy_and_honours_impl(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        rng: np.random.Generator) -> None:
    batch, n = int(rng.integers(5, 15)), int(rng.integers(40, 70))
    x = rng.uniform(0, 1, (batch, 1, 86, 86)).astype(np.float32)
    labels = rng.integers(0, 10, batch)
    monkeypatch.setattr(data, "load_images", lambda *a, **k: (x, labels))
    monkeypatch.setattr(classify, "CPU_CHUNK", 16)
    seen: list[tuple[str, int]] = []
    real = classify.LayerRunner

    class Spy(real):  # type: ignore[misc, valid-type]
        def forward(self, xb):
            seen.append((self.impl.name, len(xb)))
            return super().forward(xb)

    monkeypatch.setattr(classify, "LayerRunner", Spy)
    out = tmp_path / "r.json"
    classify.main(model="ece408", batch=batch, impl="cpu-loops", device="cpu", weights=None,
                  data_dir=None, per_layer=False, mode=None, throughput=n, self_test=False,
                  json_out=out)
    report = json.loads(out.read_text())
    pred = models.load("ece408").forward(x).argmax(axis=1)
    idx = np.arange(n) % batch
    assert report["accuracy"] == pytest.approx(float((pred == labels).mean()))
    assert report["throughput"]["images"] == n
    assert report["throughput"]["accuracy"] == pytest.approx(float((pred[idx] == labels[idx])
                                                                   .mean()))
    assert {name for name, _ in seen} == {"cpu-loops"}
    assert max(size for _, size in seen) <= 16 and sum(size for _, size in seen) == batch + n
    printed = capsys.readouterr().out
    assert f"Test Accuracy: {report['accuracy']:.4f} (first {batch} test images)" in printed
    assert f"over those {n}" in printed


def test_version_prints_the_package_version() -> None:
    from convolab import __version__

    result = runner.invoke(cli.app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"convolab {__version__}"


def test_shell_completion_is_offered() -> None:
    top = runner.invoke(cli.app, ["--help"]).output
    assert "--install-completion" in top and "--show-completion" in top


def test_each_batch_flag_says_what_it_counts() -> None:
    """One meaning per flag: classify counts test images (--images; its old --batch is
    hidden), train's --batch is the mini-batch, bench/tune/profile's the images of one conv
    call."""
    import typer.main

    commands = typer.main.get_command(cli.app).commands

    def option(command: str, flag: str) -> object:
        return next(p for p in commands[command].params if flag in getattr(p, "opts", ()))

    assert "test images" in option("classify", "--images").help
    assert option("classify", "--batch").hidden
    assert "mini-batch" in option("train", "--batch").help
    for command in ("bench", "tune", "profile"):
        assert "per conv call" in option(command, "--batch").help, command


def test_classify_batch_is_a_deprecated_alias_of_images(monkeypatch: pytest.MonkeyPatch,
                                                        ) -> None:
    seen: dict[str, int] = {}
    monkeypatch.setattr(classify, "main", lambda **kw: seen.update(batch=kw["batch"]))
    result = runner.invoke(cli.app, ["classify", "--batch", "7", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert seen == {"batch": 7} and "--images" in result.output
    result = runner.invoke(cli.app, ["classify", "--images", "9", "--device", "cpu"])
    assert seen == {"batch": 9} and "note" not in result.output
    refused(["classify", "--images", "5", "--batch", "5", "--device", "cpu"], "only --images")


def test_replot_refusals(tmp_path: Path) -> None:
    refused(["bench", "--replot", str(tmp_path / "none.json"), "--out", str(tmp_path)],
            "no results file")
    (tmp_path / "r.json").write_text("{}")
    refused(["bench", "--replot", str(tmp_path / "r.json")], "--out")
    refused(["bench", "--replot", str(tmp_path / "r.json"), "--out", str(tmp_path), "--network"],
            "times nothing")
    refused(["bench", "--replot", str(tmp_path / "r.json"), "--out", str(tmp_path)],
            "not a convolab bench results file")
