"""`convolab bench`'s small languages and plan files: --impl, --shape, --variant, --plan (good
input parses to what it says, bad input is one clear error), and a plan expands into exactly
the runs the equivalent flags give."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from convolab.bench import from_flags, load_plan
from convolab.bench.cases import layer_cases, parse_shape
from convolab.bench.plan import RunConfig, impl_grid
from convolab.bench.specs import ImplSpec, VariantSpec, parse_impl, parse_variant
from convolab.errors import ConvolabError
from convolab.models import conv_blocks
from convolab.shapes import ConvShape


def test_parse_impl_types_values_and_labels() -> None:
    spec = parse_impl("fused-conv-pool2:pipe=1,bps=2,f=0.5,mode=fast")
    assert spec == ImplSpec("fused-conv-pool2", (("pipe", 1), ("bps", 2), ("f", 0.5),
                                                 ("mode", "fast")))
    assert spec.label == "fused-conv-pool2[pipe=1,bps=2,f=0.5,mode=fast]"
    assert parse_impl("tiled") == ImplSpec("tiled") and parse_impl("tiled").label == "tiled"
    assert parse_impl("x:k=-1").params == (("k", -1),)


@pytest.mark.parametrize("text", ["", ":a=1", "tiled:", "tiled:a", "tiled:a=", "tiled:=1",
                                  "tiled:a=1,,b=2"])
def test_parse_impl_rejects_malformed(text: str) -> None:
    with pytest.raises(ConvolabError, match="--impl"):
        parse_impl(text)


def test_parse_shape_with_and_without_pool() -> None:
    case = parse_shape("3,2,12,13,5,3,1,2")
    assert case.shape == ConvShape(3, 2, 12, 13, 5, 3, 1) and case.pool == 2
    plain = parse_shape("3,2,12,13,5,3,2")
    assert plain.pool == 0 and plain.shape.S == 2 and plain.label != case.label


@pytest.mark.parametrize("text", ["1,2,3", "1,2,12,12,4,3,1,2,9", "a,2,12,12,4,3,1",
                                  "0,2,12,12,4,3,1", "1,1,4,4,1,7,1", "1,1,8,8,1,3,1,-2",
                                  "1,1,8,8,1,3,1,7"])
def test_parse_shape_rejects_bad(text: str) -> None:
    with pytest.raises(ConvolabError, match="--shape"):
        parse_shape(text)


def test_parse_variant() -> None:
    v = parse_variant("exact:c1.cw=-1,c3.pipe=-1")
    assert v.mode == "exact"
    assert v.kernel_params_dict() == {"c1": {"cw": -1}, "c3": {"pipe": -1}}
    assert parse_variant("fp16:head.imgs=32").kernel_params_dict() == {"head": {"imgs": 32}}
    assert parse_variant("tensor-core").mode == "fp16"
    assert parse_variant("tf32") == VariantSpec("tf32")


@pytest.mark.parametrize("text,match", [("fp8", "mode"), ("exact:cw=1", "LAYER.key"),
                                        ("exact:c9.cw=1", "LAYER.key"), ("exact:", "nothing"),
                                        ("exact:c1.cw", "key=value")])
def test_parse_variant_rejects_bad(text: str, match: str) -> None:
    with pytest.raises(ConvolabError, match=match):
        parse_variant(text)


def test_custom_shapes_replace_the_model_unless_a_set_is_named() -> None:
    blocks = conv_blocks("ece408", 4)
    assert [c.shape for c in layer_cases(None, "ece408", 4)] == [b.shape for b in blocks]
    only = layer_cases(None, "ece408", 4, ("2,1,9,9,2,3,1",))
    assert [c.shape for c in only] == [ConvShape(2, 1, 9, 9, 2, 3, 1)]
    both = layer_cases("model", "ece408", 4, ("2,1,9,9,2,3,1",))
    assert len(both) == len(blocks) + 1
    with pytest.raises(ConvolabError, match="--shapes"):
        layer_cases("everything", "ece408", 4)


def test_impl_grid_is_the_cartesian_product() -> None:
    specs = impl_grid("fused-conv-pool2", {"pipe": [-1, 1], "bps": [0, 2, 4], "cw": 0})
    assert len(specs) == 6
    assert {tuple(dict(s.params).items()) for s in specs} == {
        (("pipe", p), ("bps", b), ("cw", 0)) for p in (-1, 1) for b in (0, 2, 4)}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.toml"
    path.write_text(text)
    return path


def test_plan_equals_the_equivalent_flags(tmp_path: Path) -> None:
    plan = _write(tmp_path, """
batch = 64
reps = 5
[[run]]
label = "bench"
shape = ["8,1,20,20,4,5,1,2"]
impls = ["tiled"]
[run.impl.fused-conv-pool2]
pipe = [-1, 1]
bps = [0, 2]
""")
    (config,) = load_plan(plan)
    flags = from_flags("ece408", 64, 5, custom_shapes=["8,1,20,20,4,5,1,2"], impls=[
        "tiled", "fused-conv-pool2:pipe=-1,bps=0", "fused-conv-pool2:pipe=-1,bps=2",
        "fused-conv-pool2:pipe=1,bps=0", "fused-conv-pool2:pipe=1,bps=2"])
    assert config == flags
    assert [s.label for s in config.impls][1] == "fused-conv-pool2[pipe=-1,bps=0]"


def test_plan_network_run_and_defaults(tmp_path: Path) -> None:
    plan = _write(tmp_path, """
batch = 10000
reps = 20
[[run]]
label = "layers"
shapes = "model"
[[run]]
label = "network"
network = true
variants = ["exact", "fp16:head.imgs=32"]
torch = false
""")
    layers, network = load_plan(plan)
    assert layers == RunConfig(label="layers", shapes="model", batch=10000, reps=20)
    assert network == from_flags("ece408", 10000, 20, network=True,
                                 variants=["exact", "fp16:head.imgs=32"]).__class__(
        label="network", batch=10000, reps=20, network=True, torch=False,
        variants=(VariantSpec("exact"), parse_variant("fp16:head.imgs=32")))


@pytest.mark.parametrize("text,match", [
    ("batchsize = 3", "top level: unknown key 'batchsize'"),
    ("[[run]]\nreps = 'many'", "run 1: key 'reps' must be a int"),
    ("[[run]]\nshape = ['1,2']", "run 1: --shape"),
    ("[[run]]\n[[run]]\nimpls = ['x:']", "run 2: --impl"),
    ("[[run]]\nvariants = ['exact']", "run 1: --variant describes whole-network rows"),
    ("[[run]]\nnetwork = true\nimpls = ['tiled']", "run 1: --network"),
    ("[[run]]\nlabel = 'a'\n[[run]]\nlabel = 'a'", "labels must differ"),
    ("run = 3", "array of tables"),
    ("[[run]\n", "not valid TOML"),
    ("[[run]]\n[run.impl]\ntiled = 3", "impl.'tiled' must be a table"),
])
def test_plan_errors_name_the_file_and_key(tmp_path: Path, text: str, match: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConvolabError, match=str(path)) as err:
        load_plan(path)
    assert match in str(err.value)


def test_missing_plan_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConvolabError, match="no such file"):
        load_plan(tmp_path / "none.toml")


@pytest.mark.parametrize("name", sorted(p.name for p in Path("benchmarks/plans").glob("*.toml")))
def test_shipped_plans_load(name: str) -> None:
    runs = load_plan(Path("benchmarks/plans") / name)
    assert runs and all(r.reps >= 1 for r in runs)


def test_closing_plan_measures_the_issue_figures() -> None:
    runs = load_plan(Path("benchmarks/plans/closing.toml"))
    assert all(r.batch == 10_000 and r.reps >= 20 for r in runs)
    network = [r for r in runs if r.network]
    assert {v.mode for r in network for v in r.variants} >= {"exact", "fp16"}
    impls = {s.name for r in runs for s in r.impls}
    assert {"fused-conv-pool2", "fused-conv-pool4"} <= impls


@pytest.mark.parametrize("flags", [["--batch", "5"], ["--reps", "3"], ["--model", "eecs498"]])
def test_plan_refuses_run_flags_it_would_ignore(tmp_path: Path, flags: list[str]) -> None:
    plan = tmp_path / "p.toml"
    plan.write_text('batch = 4\nreps = 1\n[[run]]\nlabel = "x"\nimpls = ["cpu-im2col"]\n')
    done = subprocess.run([sys.executable, "-m", "convolab", "bench", "--plan", str(plan),
                           "--out", str(tmp_path / "out"), *flags],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert flags[0] in done.stderr and "belong in the plan file" in done.stderr
    assert not (tmp_path / "out").exists()
