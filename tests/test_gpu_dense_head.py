"""kernels/30 `dense_head`: any zoo model's layers after its last conv block, from its layer list.

GPU tests (marker `gpu`) run every zoo model's head and random head shapes against an fp64
NumPy head on fresh random data with NaN-poisoned outputs and sentinel rows past B. Without a
GPU: the layer-list extraction, the define sets and weight packing, the host's shared-memory
arithmetic checked against the kernel's through nvcc, and the kernel source itself run on the
CPU by a small emulator (one std::thread per CUDA thread, real barriers).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cuda_emulator import CUDA_SHIM, READ_SHIM

from convolab.gpu import dense_head as dh
from convolab.gpu.compile import KERNEL_DIR, define_flags
from convolab.layers import Conv2d, Flatten, Linear, MaxPool2d, ReLU, Softmax
from convolab.models import (
    MODELS,
    DenseLayer,
    build,
    conv_blocks,
    dense_layers,
    head_layers,
    param_shapes,
)
from convolab.precision import TOLERANCE

KERNEL = KERNEL_DIR / dh.KERNEL_FILE
NVCC, GXX = shutil.which("nvcc"), shutil.which("g++")
# fp32 FFMA against fp64: the project's fp32 promise (relative L2 over the batch), and a bound on
# any one probability. A logit is a sum of up to ~3000 fp32 products; on the random heads here
# (logits up to ~10) its rounding moves a probability by about 1e-5, so 1e-5 itself is too tight
# for the largest one (1.1e-5 seen on the H100 at F = 2,853).
TOL = 1e-4


def random_layers(rng: np.random.Generator, n_in: int | None = None) -> list[DenseLayer]:
    """A random head: 1-3 linear layers, odd widths included, ReLU after some hidden ones."""
    count = int(rng.integers(1, 4))
    widths = [n_in or int(rng.integers(1, 3000))] + [int(rng.integers(1, 70))
                                                      for _ in range(count - 1)]
    widths.append(int(rng.integers(2, 20)))
    return [DenseLayer(f"l{i}", widths[i], widths[i + 1],
                       bool(i < count - 1 and rng.random() < 0.7)) for i in range(count)]


def random_params(rng: np.random.Generator, layers: list[DenseLayer]) -> dict[str, np.ndarray]:
    p = {}
    for layer in layers:
        scale = 2.0 / np.sqrt(layer.in_features)
        p[f"{layer.name}.weight"] = (rng.standard_normal((layer.out_features, layer.in_features))
                                     * scale).astype(np.float32)
        p[f"{layer.name}.bias"] = (rng.standard_normal(layer.out_features) * 0.3
                                   ).astype(np.float32)
    return p


def zoo_params(model: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """models.build's weights with random biases (a zero bias would hide a bias bug)."""
    p = {k: np.asarray(v, np.float32) for k, v in build(model, int(rng.integers(1 << 30)))
         .params().items()}
    for k in p:
        if k.endswith(".bias"):
            p[k] = (0.3 * rng.standard_normal(p[k].shape)).astype(np.float32)
    return p


def random_features(rng: np.random.Generator, batch: int, n: int) -> np.ndarray:
    feat = np.abs(rng.standard_normal((batch, n))).astype(np.float32)
    feat[: batch // 3] *= 3  # larger logits: the softmax's max subtraction matters
    return feat


def head_fp64(feat: np.ndarray, layers: list[DenseLayer], p: dict[str, np.ndarray]
              ) -> np.ndarray:
    a = feat.reshape(len(feat), -1).astype(np.float64)
    for layer in layers:
        a = a @ p[f"{layer.name}.weight"].astype(np.float64).T + p[f"{layer.name}.bias"]
        if layer.relu:
            a = np.maximum(a, 0)  # keeps NaN
    z = np.exp(a - a.max(1, keepdims=True))
    return z / z.sum(1, keepdims=True)


def clear_labels(ref: np.ndarray) -> np.ndarray:
    """Images whose fp64 top-2 gap is large enough that fp32 must agree on the argmax."""
    top2 = np.sort(ref, axis=1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]) > 1e-4


# ---- the layer list -------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_head_layers_follow_the_zoo(model: str) -> None:
    head = head_layers(model)
    last = conv_blocks(model, 1)[-1]
    side = last.shape.H_out // last.pool
    assert head[0].in_features == last.shape.M * side * side  # the pooled output, flattened
    shapes = param_shapes(model)
    for layer in head:
        assert shapes[f"{layer.name}.weight"] == (layer.out_features, layer.in_features)
    for a, b in zip(head, head[1:], strict=False):
        assert a.out_features == b.in_features
    assert head[-1].out_features == 10 and not head[-1].relu
    layers = MODELS[model].layers()
    relu_after = {x.name for x, y in zip(layers, layers[1:], strict=False)
                  if isinstance(x, Linear) and isinstance(y, ReLU)}
    assert {x.name for x in head if x.relu} == relu_after


def test_dense_layers_reads_relu_flags() -> None:
    head = dense_layers([Flatten(), Linear(6, 5, name="a"), ReLU(), Linear(5, 4, name="b"),
                         Linear(4, 3, name="c"), ReLU(), Softmax()])
    assert [(x.name, x.in_features, x.out_features, x.relu) for x in head] == [
        ("a", 6, 5, True), ("b", 5, 4, False), ("c", 4, 3, True)]


@pytest.mark.parametrize("layers,message", [
    ([Linear(4, 3), Softmax()], "Flatten"),
    ([Flatten(), Linear(4, 3)], "Softmax"),
    ([Flatten(), Softmax()], "at least one Linear"),
    ([Flatten(), ReLU(), Linear(4, 3), Softmax()], "ReLU"),
    ([Flatten(), Linear(4, 3), ReLU(), ReLU(), Softmax()], "ReLU"),
    ([Flatten(), Linear(4, 3), Conv2d(1, 1, 3), Softmax()], "Conv2d"),
    ([Flatten(), Linear(4, 3), MaxPool2d(2), Softmax()], "MaxPool2d"),
    ([Flatten(), Linear(4, 3), Linear(5, 2), Softmax()], "3 outputs feed 5"),
])
def test_dense_layers_rejects(layers: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dense_layers(layers)


# ---- host arithmetic --------------------------------------------------------------------------


def test_head_defines_cover_the_outputs(rng: np.random.Generator) -> None:
    for n1 in [1, 2, 7, 8, 9, 10, 17, 32, 33, 100, 256] + list(rng.integers(1, 257, 10)):
        n1 = int(n1)
        d = dh.head_defines([DenseLayer("a", 100, n1, False)])
        og, to = d["DH_OG"], d["DH_TO"]
        assert og & (og - 1) == 0 and to <= dh.MAX_TO and og * to >= n1
        assert og == 1 or -(-n1 // (og // 2)) > dh.MAX_TO  # the fewest groups
        assert dh.THREADS % (d["DH_IMGS"] // d["DH_TI"] * og) == 0
    assert dh.head_defines([DenseLayer("a", 1023, 10, False)])["DH_VEC"] == 1
    assert dh.head_defines([DenseLayer("a", 1024, 10, False)])["DH_VEC"] == 4
    with pytest.raises(ValueError, match="outputs in the first layer"):
        dh.head_defines([DenseLayer("a", 100, 400, False)])
    with pytest.raises(ValueError, match="shared memory"):
        dh.head_defines([DenseLayer("a", 100, 10, True), DenseLayer("b", 10, 5000, False)])
    with pytest.raises(ValueError, match="linear layers"):
        dh.head_defines([DenseLayer("a", 4, 4, True)] * 5)
    with pytest.raises(ValueError, match="imgs"):
        dh.head_defines(head_layers("ece408"), imgs=48)
    with pytest.raises(ValueError, match="kc"):
        dh.head_defines(head_layers("ece408"), kc=32)
    with pytest.raises(ValueError, match="ti"):
        dh.head_defines(head_layers("ece408"), ti=3)
    # the first default tile that fits: the zoo's heads take the first, a wide layer the last
    tile = ("DH_IMGS", "DH_KC", "DH_TI")
    for model in MODELS:
        d = dh.head_defines(head_layers(model))
        assert tuple(d[k] for k in tile) == dh.DEFAULT_TILES[0], model
    wide = dh.head_defines([DenseLayer("a", 100, 256, False)])
    assert tuple(wide[k] for k in tile) == dh.DEFAULT_TILES[-1]
    assert dh.head_defines(head_layers("eecs498"), imgs=16)["DH_TI"] == dh.DEFAULT_TILES[-1][2]
    with pytest.raises(ValueError, match="ti to divide imgs"):
        dh.head_defines(head_layers("ece408-mxnet"), 64, ti=5)
    with pytest.raises(ValueError, match="split evenly"):
        dh.head_defines(head_layers("ece408-mxnet"), 40, kc=64, ti=5)
    # 16 images, 2 a thread, 4 output groups: 8 k groups; kc 64 fills them
    assert dh.head_defines([DenseLayer("a", 100, 32, False)], 16, kc=64, ti=2)["DH_TI"] == 2
    with pytest.raises(ValueError, match="outputs in the first layer"):
        dh.head_defines([DenseLayer("a", 100, 256, False)], 64, ti=2)
    # `to` raises the outputs a thread: the zoo's 10 classes in one group
    for to, og in ((10, 1), (16, 1), (5, 2), (4, 4)):
        d = dh.head_defines(head_layers("eecs498"), to=to)
        assert (d["DH_OG"], d["DH_TO"]) == (og, -(-10 // og)), to
    with pytest.raises(ValueError, match="to .outputs a thread"):
        dh.head_defines(head_layers("eecs498"), to=dh.TO_LIMIT + 1)


@pytest.mark.parametrize("model", list(MODELS))
def test_packed_weights_compute_the_head(model: str, rng: np.random.Generator) -> None:
    """The packed arrays, read as the kernel reads them, give the fp64 head: padding is zero and
    every layer's weights sit where the kernel's offsets say."""
    layers, p = head_layers(model), zoo_params(model, rng)
    d = dh.head_defines(layers)
    w1t, b1, wtail, btail = dh.pack_weights(layers, p, d)
    assert w1t.shape == (-(-layers[0].in_features // d["DH_KC"]) * d["DH_KC"],
                         d["DH_OG"] * d["DH_TO"])
    feat = random_features(rng, 5, layers[0].in_features)
    pad = np.zeros((5, w1t.shape[0]))
    pad[:, : feat.shape[1]] = feat
    a = (pad @ w1t.astype(np.float64))[:, : layers[0].out_features] + b1
    a = np.maximum(a, 0) if layers[0].relu else a
    woff = boff = 0
    for layer in layers[1:]:
        n = layer.out_features * layer.in_features
        a = a @ wtail[woff: woff + n].reshape(layer.out_features, -1).T.astype(np.float64)
        a = a + btail[boff: boff + layer.out_features]
        a = np.maximum(a, 0) if layer.relu else a
        woff, boff = woff + n, boff + layer.out_features
    assert woff == (len(wtail) if len(layers) > 1 else 0)
    z = np.exp(a - a.max(1, keepdims=True))
    np.testing.assert_allclose(z / z.sum(1, keepdims=True), head_fp64(feat, layers, p),
                               atol=1e-12)


def test_pack_weights_checks_params(rng: np.random.Generator) -> None:
    layers = head_layers("ece408")
    p = zoo_params("ece408", rng)
    d = dh.head_defines(layers)
    with pytest.raises(ValueError, match="f6.weight"):
        dh.pack_weights(layers, {k: v for k, v in p.items() if k != "f6.weight"}, d)
    with pytest.raises(ValueError, match="expected"):
        dh.pack_weights(layers, {**p, "f5.bias": np.zeros(31, np.float32)}, d)


def _nvcc(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(NVCC), "-arch=sm_90", "-std=c++17", "-cubin", "-o", "/dev/null",
                           *flags, str(KERNEL)], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_smem_bytes_agree_with_kernel(rng: np.random.Generator) -> None:
    d = random_head_defines(rng)
    ok = _nvcc(*define_flags({**d, "DH_EXPECT_SMEM": dh.smem_bytes(d)}))
    assert ok.returncode == 0, (d, ok.stderr[-2000:])
    off = _nvcc(*define_flags({**d, "DH_EXPECT_SMEM": dh.smem_bytes(d) + 4}))
    assert off.returncode != 0 and "disagree" in off.stderr


def random_head_defines(rng: np.random.Generator) -> dict[str, int]:
    """A random head with one of the image tiles it takes (tile_choices), drawn at random."""
    for _ in range(100):
        layers = random_layers(rng)
        choices = tile_choices(layers)
        if choices:
            imgs, kc, ti = choices[int(rng.integers(len(choices)))]
            return dh.head_defines(layers, imgs, kc=kc, ti=ti)
    raise AssertionError("no random head of 100 takes any tile")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("defines,message", [
    ({"DH_OG": 1}, "cover DH_N1"),
    ({"DH_KC": 60}, "DH_KC"),
    ({"DH_F": 1023}, "DH_VEC 4"),
    ({"DH_L": 5}, "DH_L"),
])
def test_kernel_rejects_bad_defines(defines: dict[str, int], message: str) -> None:
    proc = _nvcc(*define_flags(defines))
    assert proc.returncode != 0 and message in proc.stderr


# ---- the kernel source on the CPU -----------------------------------------------------------

EMU = CUDA_SHIM + READ_SHIM + r"""
std::barrier<>* block_bar;
inline void __syncthreads() { block_bar->arrive_and_wait(); }
alignas(16) float dh_smem[227 * 1024 / 4];
#include "kernel.inc"
static size_t count(const char* dir, const char* name, size_t size) {
  char path[1024]; snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE* f = fopen(path, "rb");
  fseek(f, 0, SEEK_END);
  const size_t n = ftell(f) / size;
  fclose(f);
  return n;
}
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int B = atoi(argv[2]), flags = atoi(argv[3]);
  float* feat = read<float>(dir, "feat.bin", count(dir, "feat.bin", 4));
  float* w1t = read<float>(dir, "w1t.bin", count(dir, "w1t.bin", 4));
  float* b1 = read<float>(dir, "b1.bin", count(dir, "b1.bin", 4));
  float* wtail = read<float>(dir, "wtail.bin", count(dir, "wtail.bin", 4));
  float* btail = read<float>(dir, "btail.bin", count(dir, "btail.bin", 4));
  const size_t np_ = count(dir, "probs.bin", 4), nl = count(dir, "labels.bin", 1);
  float* probs = read<float>(dir, "probs.bin", np_);
  unsigned char* labels = read<unsigned char>(dir, "labels.bin", nl);
  gridDim.x = (B + DH_IMGS - 1) / DH_IMGS;
  for (unsigned b = 0; b < gridDim.x; ++b) {
    std::fill(dh_smem, dh_smem + 227 * 1024 / 4, NAN);  // unwritten shared memory shows
    std::barrier<> bb(DH_THREADS);
    block_bar = &bb;
    std::vector<std::thread> ts;
    for (int t = 0; t < DH_THREADS; ++t)
      ts.emplace_back([=] {
        threadIdx.x = t;
        blockIdx.x = b;
        dense_head(feat, w1t, b1, wtail, btail, probs, labels, B, flags);
      });
    for (auto& t : ts) t.join();
  }
  char path[1024]; snprintf(path, sizeof path, "%s/probs_out.bin", dir);
  FILE* f = fopen(path, "wb"); fwrite(probs, 4, np_, f); fclose(f);
  snprintf(path, sizeof path, "%s/labels_out.bin", dir);
  f = fopen(path, "wb"); fwrite(labels, 1, nl, f); fclose(f);
}
"""

SENTINEL = 7  # rows past B in the outputs, which must stay untouched


def tile_choices(layers: list[DenseLayer]) -> list[tuple[int, int, int]]:
    """Every (imgs, kc, ti) the head's define set takes for these layers."""
    ok = []
    for imgs in dh.IMGS_CHOICES:
        for kc in dh.KC_CHOICES:
            for ti in dh.TI_CHOICES:
                try:
                    dh.head_defines(layers, imgs, kc=kc, ti=ti)
                except ValueError:
                    continue
                ok.append((imgs, kc, ti))
    return ok


def _emulate(tmp_path: Path, layers: list[DenseLayer], p: dict[str, np.ndarray],
             feat: np.ndarray, imgs: int, kc: int, ti: int) -> tuple[np.ndarray, np.ndarray]:
    d = dh.head_defines(layers, imgs, kc=kc, ti=ti)
    source = KERNEL.read_text().replace('#include "common.cuh"', "")
    assert "asm" not in source, "inline PTX the emulator does not know"
    (tmp_path / "kernel.inc").write_text(source)
    (tmp_path / "emu.cpp").write_text(EMU)
    exe = tmp_path / "emu"
    build_ = subprocess.run([str(GXX), "-std=c++20", "-O1", "-pthread", "-w", *define_flags(d),
                             "-o", str(exe), str(tmp_path / "emu.cpp")], capture_output=True,
                            text=True, timeout=300)
    assert build_.returncode == 0, build_.stderr[-3000:]
    batch, classes = len(feat), layers[-1].out_features
    arrays = dict(zip(("w1t", "b1", "wtail", "btail"), dh.pack_weights(layers, p, d),
                      strict=True))
    arrays["feat"] = feat
    arrays["probs"] = np.full((batch + SENTINEL, classes), np.nan, np.float32)
    for name, a in arrays.items():
        np.ascontiguousarray(a, np.float32).tofile(tmp_path / f"{name}.bin")
    np.full(batch + SENTINEL, 77, np.uint8).tofile(tmp_path / "labels.bin")
    run = subprocess.run([str(exe), str(tmp_path), str(batch), "3"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    probs = np.fromfile(tmp_path / "probs_out.bin", np.float32).reshape(batch + SENTINEL, -1)
    labels = np.fromfile(tmp_path / "labels_out.bin", np.uint8)
    assert np.isnan(probs[batch:]).all() and (labels[batch:] == 77).all(), "wrote past B"
    return probs[:batch], labels[:batch]


def check_head(probs: np.ndarray, labels: np.ndarray | None, feat: np.ndarray,
               layers: list[DenseLayer], p: dict[str, np.ndarray]) -> None:
    """Probabilities within TOL of fp64 (NaN exactly where fp64 has it), labels the argmax of
    the returned probabilities, and the fp64 argmax where its top-2 gap is clear."""
    ref = head_fp64(feat, layers, p)
    bad = np.isnan(ref).any(1)
    assert np.array_equal(np.isnan(probs).any(1), bad)
    assert np.isnan(probs[bad]).all()
    assert np.abs(probs[~bad] - ref[~bad]).max() <= TOL
    if (~bad).any():
        diff = probs[~bad] - ref[~bad]
        assert np.linalg.norm(diff) <= TOLERANCE["fp32"] * np.linalg.norm(ref[~bad])
    if labels is not None:
        assert (labels[bad] == dh.NAN_LABEL).all()
        np.testing.assert_array_equal(labels[~bad], probs[~bad].argmax(1))
        clear = clear_labels(ref) & ~bad
        np.testing.assert_array_equal(labels[clear], ref[clear].argmax(1))


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("case", list(MODELS) + ["random-odd", "random-deep"])
def test_kernel_emulated_on_cpu(case: str, tmp_path: Path, rng: np.random.Generator) -> None:
    if case in MODELS:
        layers, p = head_layers(case), zoo_params(case, rng)
    else:  # an odd F (scalar loads) or a deeper head with hidden widths off the tile sizes
        n_in = int(rng.integers(1, 300)) * 2 + 1 if case == "random-odd" else None
        layers = random_layers(rng, n_in)
        if case == "random-deep":
            layers = [DenseLayer("a", int(rng.integers(1, 400)) * 4, 37, True),
                      DenseLayer("b", 37, 13, False), DenseLayer("c", 13, 21, True),
                      DenseLayer("d", 21, 7, False)]
        p = random_params(rng, layers)
    choices = tile_choices(layers)
    imgs, kc, ti = choices[int(rng.integers(len(choices)))]
    batch = int(rng.choice([1, imgs - 1, imgs + 1, 2 * imgs + 3]))
    feat = random_features(rng, batch, layers[0].in_features)
    if batch > 2:
        feat[batch // 2, 0] = np.nan  # also poisons a neighbour that reads past its row end
    print(f"tile: imgs {imgs}, kc {kc}, ti {ti}")
    probs, labels = _emulate(tmp_path, layers, p, feat, imgs, kc, ti)
    check_head(probs, labels, feat, layers, p)


# ---- on the GPU -------------------------------------------------------------------------------


def _gpu_run(cp: object, head: object, feat: np.ndarray, classes: int) -> tuple:
    batch = len(feat)
    probs = cp.full((batch + SENTINEL, classes), cp.nan, cp.float32)  # type: ignore[attr-defined]
    labels = cp.full(batch + SENTINEL, 77, cp.uint8)  # type: ignore[attr-defined]
    head(cp.asarray(feat), probs[:batch], labels[:batch])  # type: ignore[attr-defined,operator]
    p, lab = probs.get(), labels.get()
    assert np.isnan(p[batch:]).all() and (lab[batch:] == 77).all(), "wrote past B"
    return p[:batch], lab[:batch]


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("batch", [1, 31, 33, 1000, 10007])
def test_zoo_head_matches_fp64(model: str, batch: int, rng: np.random.Generator) -> None:
    import cupy as cp

    layers, p = head_layers(model), zoo_params(model, rng)
    feat = random_features(rng, batch, layers[0].in_features)
    if batch > 2:
        feat[batch // 2, 5] = np.nan  # one image with a NaN feature: only its row is NaN
    probs, labels = _gpu_run(cp, dh.prepare_dense_head(model, p), feat, 10)
    check_head(probs, labels, feat, layers, p)


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("to", [5, 8, 16])
def test_zoo_head_thread_tiles_match_fp64(model: str, to: int, rng: np.random.Generator) -> None:
    """`to` outputs a thread (the default MAX_TO is the zoo_head test's): two groups of 5 for
    the wide models' 10 classes, 8, or all in one group. Odd batches, a NaN."""
    import cupy as cp

    layers, p = head_layers(model), zoo_params(model, rng)
    batch = int(rng.integers(900, 1100))
    feat = random_features(rng, batch, layers[0].in_features)
    feat[batch // 2, 3] = np.nan
    head = dh.prepare_dense_head(model, p, to=to)
    assert head.defines["DH_TO"] <= to  # type: ignore[attr-defined]
    probs, labels = _gpu_run(cp, head, feat, 10)
    check_head(probs, labels, feat, layers, p)


@pytest.mark.gpu
@pytest.mark.parametrize("imgs", dh.IMGS_CHOICES)
@pytest.mark.parametrize("kc", dh.KC_CHOICES)
@pytest.mark.parametrize("ti", dh.TI_CHOICES)
def test_random_heads_match_fp64(imgs: int, kc: int, ti: int, rng: np.random.Generator) -> None:
    import cupy as cp

    tried = 0
    for _ in range(20):  # 2 heads a tile that takes them, each compiled
        layers = random_layers(rng)
        if (imgs, kc, ti) not in tile_choices(layers):
            continue
        p = random_params(rng, layers)
        feat = random_features(rng, int(rng.integers(1, 3000)), layers[0].in_features)
        probs, labels = _gpu_run(cp, dh.prepare_layers(layers, p, imgs, kc, ti), feat,
                                 layers[-1].out_features)
        check_head(probs, labels, feat, layers, p)
        tried += 1
        if tried == 2:
            break
    if not tried:
        pytest.skip(f"no random head of 20 takes imgs {imgs}, kc {kc}, ti {ti}")


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODELS))
def test_head_is_deterministic_per_image_and_alignment(model: str,
                                                       rng: np.random.Generator) -> None:
    """Each image's sums run in a fixed order whatever its tile, batch or load width: the
    first 1000 images alone, a second launch, and a misaligned copy (scalar loads) give the
    same bits; probs-only and labels-only launches agree with the combined one."""
    import cupy as cp

    layers, p = head_layers(model), zoo_params(model, rng)
    head = dh.prepare_dense_head(model, {k: cp.asarray(v) for k, v in p.items()})
    n = layers[0].in_features
    feat = cp.asarray(random_features(rng, 5000, n))
    full, again = cp.empty((5000, 10), cp.float32), cp.empty((5000, 10), cp.float32)
    labels, part = cp.empty(5000, cp.uint8), cp.empty((1000, 10), cp.float32)
    head(feat, full)
    head(feat, again, labels)
    head(feat[:1000], part)
    flat = cp.empty(1000 * n + 1, cp.float32)
    odd = flat[1:].reshape(1000, n)  # 4 bytes past a 16-byte boundary
    odd[...] = feat[:1000]
    shifted, only_labels = cp.empty((1000, 10), cp.float32), cp.empty(1000, cp.uint8)
    head(odd, shifted)
    head(odd, None, only_labels)
    np.testing.assert_array_equal(full.get(), again.get())
    np.testing.assert_array_equal(part.get(), full[:1000].get())
    np.testing.assert_array_equal(shifted.get(), part.get())
    np.testing.assert_array_equal(only_labels.get(), labels[:1000].get())
    np.testing.assert_array_equal(labels.get(), full.get().argmax(1))


@pytest.mark.gpu
def test_head_rejects_bad_arrays(rng: np.random.Generator) -> None:
    import cupy as cp

    p = zoo_params("ece408", rng)
    head = dh.prepare_dense_head("ece408", p)
    feat = cp.asarray(random_features(rng, 64, 1024))
    with pytest.raises(ValueError, match="features"):
        head(feat[::2], cp.empty((32, 10), cp.float32))
    with pytest.raises(ValueError, match="features"):
        head(feat[:, :512], cp.empty((64, 10), cp.float32))
    with pytest.raises(ValueError, match="features"):
        head(feat.astype(cp.float64), cp.empty((64, 10), cp.float32))
    with pytest.raises(ValueError, match="probs"):
        head(feat, cp.empty((64, 9), cp.float32))
    with pytest.raises(ValueError, match="labels"):
        head(feat, None, cp.empty(64, cp.int32))
    with pytest.raises(ValueError, match="probs, labels or both"):
        head(feat)
    head(feat[:0], cp.empty((0, 10), cp.float32))  # B = 0: no launch
