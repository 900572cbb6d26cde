"""ONNX export and import: onnx.checker, onnxruntime agreeing on every test image, round trips,
a hand-built foreign graph, and one clear error for what the importer cannot compute."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from convolab import data, models, onnx_io  # noqa: E402
from convolab.errors import ConvolabError  # noqa: E402

# fp32 forwards that sum in different orders (ORT's conv/GEMM vs convolab's im2col+BLAS) over
# at most 1024-long dot products of softmax-bounded values: measured max |dp| ~2.4e-6.
PROB_TOL = 1e-4


def _dataset_or_skip() -> None:
    try:
        data.find_dataset(split="test")
    except ConvolabError as err:
        pytest.skip(f"Fashion-MNIST test split not installed: {err}")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("onnx")
    out = {}
    for name in models.MODELS:
        net = models.load(name)
        out[name] = (net, onnx_io.export_onnx(net, folder / f"{name}.onnx",
                                              models.spec(name).input_size))
    return out


def _session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(models.MODELS))
def test_export_agrees_with_onnxruntime_on_every_test_image(exported, name):
    _dataset_or_skip()
    net, path = exported[name]
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["images"]
    assert [o.name for o in model.graph.output] == ["probabilities"]
    x, _ = data.load_images("test", size=models.spec(name).input_size)
    assert len(x) == 10_000
    ours = np.concatenate([net.forward(x[i:i + 1000]) for i in range(0, len(x), 1000)])
    theirs = _session(path).run(None, {"images": x})[0]
    assert theirs.shape == (10_000, 10)
    assert np.array_equal(ours.argmax(axis=1), theirs.argmax(axis=1))
    assert float(np.abs(ours - theirs).max()) < PROB_TOL


@pytest.mark.parametrize("name", list(models.MODELS))
def test_round_trip_keeps_zoo_names_and_predictions(exported, name, rng):
    net, path = exported[name]
    imported = onnx_io.import_onnx(path)
    assert imported.zoo_model == name
    assert imported.input_size == models.spec(name).input_size
    assert imported.network.name == name
    params, original = imported.network.params(), net.params()
    assert list(params) == list(original)
    for key in params:
        np.testing.assert_array_equal(params[key], original[key])
    x = rng.random((64, 1, imported.input_size, imported.input_size), dtype=np.float32)
    np.testing.assert_array_equal(imported.network.predict(x), net.predict(x))


@pytest.mark.slow
def test_round_trip_predictions_on_test_images(exported):
    _dataset_or_skip()
    net, path = exported["ece408"]
    x, _ = data.load_images("test", n=2000, size=models.spec("ece408").input_size)
    np.testing.assert_array_equal(onnx_io.network_from_onnx(path).predict(x), net.predict(x))


def test_dynamic_batch(exported, rng):
    net, path = exported["eecs498"]
    for batch in (1, 3):
        x = rng.random((batch, 1, 64, 64), dtype=np.float32)
        got = _session(path).run(None, {"images": x})[0]
        np.testing.assert_allclose(got, net.forward(x), atol=PROB_TOL)


# ----------------------------------------------------------------------------- a foreign graph


def _init(name: str, value: np.ndarray):
    return numpy_helper.from_array(np.ascontiguousarray(value, dtype=np.float32), name)


def _foreign_ece408(net, *, conv_pads: list[int] | None = None, extra_op: str | None = None):
    """The ece408 network as another exporter might write it: Constant-node weights, Dropout
    and Identity in between, Reshape(0,-1) then Gemm(transB=1) for F5, MatMul+Add with (in, out)
    weights for F6, Softmax(axis=1), other tensor and node names."""
    p = net.params()
    nodes = [
        helper.make_node("Constant", [], ["w1"], value=numpy_helper.from_array(p["c1.weight"])),
        helper.make_node("Conv", ["input.1", "w1", "b1"], ["t1"], name="/features/conv1",
                         kernel_shape=[7, 7], pads=conv_pads or [0, 0, 0, 0]),
        helper.make_node("Relu", ["t1"], ["t2"], name="/features/relu1"),
        helper.make_node("MaxPool", ["t2"], ["t3"], name="/features/pool1", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Conv", ["t3", "w3", "b3"], ["t4"], name="/features/conv2"),
        helper.make_node("Relu", ["t4"], ["t5"], name="/features/relu2"),
        helper.make_node("MaxPool", ["t5"], ["t6"], name="/features/pool2", kernel_shape=[4, 4],
                         strides=[4, 4]),
        helper.make_node("Dropout", ["t6"], ["t7"], name="/drop"),
        helper.make_node("Reshape", ["t7", "flat_shape"], ["t8"], name="/flatten"),
        helper.make_node("Gemm", ["t8", "w5", "b5"], ["t9"], name="/fc1", transB=1),
        helper.make_node("Relu", ["t9"], ["t10"], name="/relu3"),
        helper.make_node("MatMul", ["t10", "w6t"], ["t11"], name="/fc2/MatMul"),
        helper.make_node("Add", ["t11", "b6"], ["t12"], name="/fc2/Add"),
        helper.make_node("Identity", ["t12"], ["t13"], name="/id"),
        helper.make_node("Softmax", ["t13"], ["output"], name="/softmax", axis=1),
    ]
    if extra_op is not None:
        nodes[-1] = helper.make_node(extra_op, ["t13"], ["output"], name="/head")
    inits = [_init("b1", p["c1.bias"]), _init("w3", p["c3.weight"]), _init("b3", p["c3.bias"]),
             _init("w5", p["f5.weight"]), _init("b5", p["f5.bias"]),
             _init("w6t", p["f6.weight"].T), _init("b6", p["f6.bias"]),
             numpy_helper.from_array(np.array([0, -1], np.int64), "flat_shape")]
    graph = helper.make_graph(
        nodes, "torch_jit",
        [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, ["batch", 1, 86, 86])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 10])],
        initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)


def test_foreign_graph_imports_as_the_zoo_model(tmp_path, rng):
    net = models.load("ece408")
    path = tmp_path / "foreign.onnx"
    onnx.save(_foreign_ece408(net), str(path))
    imported = onnx_io.import_onnx(path)
    assert imported.zoo_model == "ece408"
    for key, value in net.params().items():
        np.testing.assert_allclose(imported.network.params()[key], value, rtol=0, atol=0)
    x = rng.random((32, 1, 86, 86), dtype=np.float32)
    np.testing.assert_allclose(imported.network.forward(x), net.forward(x), atol=1e-6)
    # and onnxruntime runs the same foreign graph to the same probabilities
    got = _session(path).run(None, {"input.1": x})[0]
    np.testing.assert_allclose(got, net.forward(x), atol=PROB_TOL)


def test_non_zoo_graph_gets_generic_names(tmp_path, rng):
    w = rng.standard_normal((3, 1, 3, 3)).astype(np.float32)
    fc = rng.standard_normal((5, 3 * 4 * 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["a"], name="conv", strides=[2, 2]),
         helper.make_node("AveragePool", ["a"], ["b"], kernel_shape=[2, 2], strides=[1, 1]),
         helper.make_node("Flatten", ["b"], ["c"]),
         helper.make_node("Gemm", ["c", "fc"], ["y"], transB=1, alpha=0.5)],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 1, 11, 11])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 5])],
        initializer=[_init("w", w), _init("fc", fc)])
    path = tmp_path / "tiny.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                ir_version=8), str(path))
    imported = onnx_io.import_onnx(path)
    assert imported.zoo_model is None
    assert imported.network.name == "onnx:tiny"
    assert list(imported.network.params()) == ["conv1.weight", "fc1.weight"]
    x = rng.random((4, 1, 11, 11), dtype=np.float32)
    want = _session(path).run(None, {"x": x})[0]
    np.testing.assert_allclose(imported.network.forward(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("change", "words"), [
    ({"extra_op": "Sigmoid"}, ["'/head'", "Sigmoid", "unsupported op"]),
    ({"conv_pads": [1, 1, 1, 1]}, ["'/features/conv1'", "Conv", "pads"]),
])
def test_unsupported_node_is_one_error_naming_it(tmp_path, change, words):
    path = tmp_path / "bad.onnx"
    onnx.save(_foreign_ece408(models.load("ece408"), **change), str(path))
    with pytest.raises(ConvolabError) as err:
        onnx_io.network_from_onnx(path)
    message = str(err.value)
    assert all(w in message for w in words), message
    assert str(path) in message and "\n" not in message


def test_missing_or_garbled_file_is_one_error(tmp_path):
    with pytest.raises(ConvolabError, match="does not exist"):
        onnx_io.network_from_onnx(tmp_path / "none.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf at all")
    with pytest.raises(ConvolabError, match="not a valid ONNX model"):
        onnx_io.network_from_onnx(bad)


def test_export_refuses_bad_opset_and_wrong_size(tmp_path):
    net = models.build("ece408")
    with pytest.raises(ConvolabError, match="--opset"):
        onnx_io.export_onnx(net, tmp_path / "a.onnx", 86, opset=9)
    with pytest.raises(ConvolabError, match="f5.*1024 features"):
        onnx_io.export_onnx(net, tmp_path / "a.onnx", 64)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_cli_export_then_classify_onnx(tmp_path):
    from typer.testing import CliRunner

    from convolab.cli import app

    _dataset_or_skip()
    out = tmp_path / "m.onnx"
    result = CliRunner().invoke(app, ["export", "--model", "eecs498", str(out)])
    assert result.exit_code == 0, result.output
    assert onnx_io.import_onnx(out).zoo_model == "eecs498"
    result = CliRunner().invoke(app, ["classify", "--onnx", str(out), "--device", "cpu",
                                      "-b", "50", "--no-self-test"])
    assert result.exit_code == 0, result.output
    assert "Test Accuracy" in result.output
    result = CliRunner().invoke(app, ["export", str(tmp_path / "no" / "x.onnx")])
    # app() leaves ConvolabError to cli.main, which prints "error: ..." and exits 2
    assert isinstance(result.exception, ConvolabError)
    assert "does not exist" in str(result.exception)
