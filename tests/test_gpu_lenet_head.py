"""kernels/20 `lenet_head` (F5 + ReLU, F6, softmax; persistent, weights in shared memory).

GPU tests (marker `gpu`) run every tuned define set against an fp64 NumPy head on fresh random
data with NaN-poisoned outputs and sentinel rows past B. Without a GPU: the host's geometry and
shared-memory arithmetic, checked against the kernel's own through nvcc, and the kernel source
itself run on the CPU by a small emulator (one std::thread per CUDA thread, real barriers,
cp.async copies deferred to the wait that covers them), which catches index and pipeline
errors, not timing ones.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cuda_emulator import CUDA_SHIM
from test_gpu_fused import lenet_params

from convolab.conv_cpu import reference_forward
from convolab.gpu import lenet_head as gnet
from convolab.gpu.compile import KERNEL_DIR, define_flags
from convolab.models import conv_blocks

KERNEL = KERNEL_DIR / gnet.KERNEL_FILE
NVCC, GXX = shutil.which("nvcc"), shutil.which("g++")


def random_head(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"w5": (rng.standard_normal((32, 1024)) * 0.05).astype(np.float32),
            "b5": (rng.standard_normal(32) * 0.1).astype(np.float32),
            "w6": (rng.standard_normal((10, 32)) * 0.3).astype(np.float32),
            "b6": (rng.standard_normal(10) * 0.1).astype(np.float32)}


def random_features(rng: np.random.Generator, batch: int) -> np.ndarray:
    feat = np.abs(rng.standard_normal((batch, 1024))).astype(np.float32)
    feat[: batch // 3] *= 3  # larger logits: the softmax's max subtraction matters
    return feat


def head_fp64(feat: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
    f = {k: v.astype(np.float64) for k, v in p.items()}
    h = np.maximum(feat.astype(np.float64) @ f["w5"].T + f["b5"], 0)
    z = h @ f["w6"].T + f["b6"]
    z = np.exp(z - z.max(1, keepdims=True))
    return z / z.sum(1, keepdims=True)


# ---- host arithmetic --------------------------------------------------------------------------


def test_head_defines_and_grid() -> None:
    assert gnet.HEAD_DEFAULT_IMGS in gnet.HEAD_IMGS_CHOICES
    for imgs in gnet.HEAD_IMGS_CHOICES:
        d = gnet.head_defines(imgs)
        assert d["HEAD_IMGS"] == imgs
        assert gnet.head_smem_bytes(d) <= 227 * 1024
        assert gnet.head_grid(10000, d, 132) == 132
        assert gnet.head_grid(1, d, 132) == 1
        assert gnet.head_grid(imgs + 1, d, 132) == 2
    for bad in (8, 64, 0):
        with pytest.raises(ValueError, match="head imgs"):
            gnet.head_defines(bad)
    # 4 * (weights + ring + partial sums): 16 images, k chunks of 32, 3 stages, 2 buffers
    assert gnet.head_smem_bytes(gnet.head_defines(16)) == 4 * (32768 + 8 * 3 * 16 * 36
                                                               + 2 * 8 * 16 * 32)


def test_fused_lenet_rejects_head_size_without_gpu(seed: int) -> None:
    from convolab.gpu.network import FusedLeNet

    with pytest.raises(ValueError, match="head imgs"):
        FusedLeNet(lenet_params(seed), kernel_params={"head": {"imgs": 48}})


def _nvcc(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(NVCC), "-arch=sm_90", "-std=c++17", "-cubin", "-o", "/dev/null",
                           *flags, str(KERNEL)], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("imgs", gnet.HEAD_IMGS_CHOICES)
def test_head_smem_bytes_agree_with_kernel(imgs: int) -> None:
    d = gnet.head_defines(imgs)
    ok = _nvcc(*define_flags({**d, "HEAD_EXPECT_SMEM": gnet.head_smem_bytes(d)}))
    assert ok.returncode == 0, ok.stderr[-2000:]
    off = _nvcc(*define_flags({**d, "HEAD_EXPECT_SMEM": gnet.head_smem_bytes(d) + 4}))
    assert off.returncode != 0 and "disagree" in off.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("defines,message", [
    ({"HEAD_KC": 64, "HEAD_NS": 3}, "227 KB"),
    ({"HEAD_LO": 2}, "HEAD_LO"),
    ({"HEAD_IMGS": 12}, "HEAD_IMGS"),
    ({"HEAD_NS": 1}, "HEAD_NS"),
])
def test_head_kernel_rejects_bad_defines(defines: dict[str, int], message: str) -> None:
    proc = _nvcc(*define_flags(defines))
    assert proc.returncode != 0 and message in proc.stderr


# ---- the kernel source on the CPU -----------------------------------------------------------

EMU = CUDA_SHIM + r"""
std::barrier<>* block_bar;
std::barrier<>* warp_bar[32];
float shfl[32][32];
inline void __syncthreads() { block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  shfl[w][l] = v;
  __syncwarp();
  const float r = shfl[w][l ^ off];
  __syncwarp();
  return r;
}
int late = 1;  // 1: a cp.async lands at the wait that covers it; 0: at once
struct Copy { float* dst; const float* src; };
thread_local std::vector<std::vector<Copy>> groups;
thread_local std::vector<Copy> open_group;
inline void emu_cp16(float* dst, const float* src) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 || reinterpret_cast<uintptr_t>(src) % 16) std::abort();
  if (late) open_group.push_back({dst, src}); else std::memcpy(dst, src, 16);
}
inline void emu_commit() { groups.push_back(open_group); open_group.clear(); }
inline void emu_wait(int n) {
  while ((int)groups.size() > n) {
    for (auto& c : groups.front()) std::memcpy(c.dst, c.src, 16);
    groups.erase(groups.begin());
  }
}
// common.cuh's cp.async wrappers, as the kernel calls them
inline void cp_async16(void* dst, const void* src) {
  emu_cp16(static_cast<float*>(dst), static_cast<const float*>(src));
}
inline void cp_async_commit() { emu_commit(); }
template <int N> inline void cp_async_wait() { emu_wait(N); }
inline void cp_async_wait_all() { emu_wait(0); }
alignas(16) float head_smem[232448 / 4];
#include "kernel.inc"
static float* read(const char* dir, const char* name, size_t n) {
  float* p = static_cast<float*>(std::aligned_alloc(16, ((n * 4 + 15) / 16) * 16));
  char path[1024]; snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE* f = fopen(path, "rb");
  if (!f || fread(p, 4, n, f) != n) std::abort();
  fclose(f);
  return p;
}
int main(int argc, char** argv) {
  const char* dir = argv[1];
  const int B = atoi(argv[2]), grid = atoi(argv[3]);
  late = atoi(argv[4]);
  float* feat = read(dir, "feat.bin", (size_t)B * 1024);
  float* w5t = read(dir, "w5t.bin", 32768);
  float* b5 = read(dir, "b5.bin", 32);
  float* w6 = read(dir, "w6.bin", 320);
  float* b6 = read(dir, "b6.bin", 10);
  float* probs = read(dir, "probs.bin", (size_t)(B + 16) * 10);
  gridDim.x = grid;
  for (int b = 0; b < grid; ++b) {
    std::fill(head_smem, head_smem + 232448 / 4, NAN);  // unwritten shared memory shows
    std::barrier<> bb(HEAD_THREADS);
    block_bar = &bb;
    for (int w = 0; w < HEAD_THREADS / 32; ++w) warp_bar[w] = new std::barrier<>(32);
    std::vector<std::thread> ts;
    for (int t = 0; t < HEAD_THREADS; ++t)
      ts.emplace_back([=] {
        threadIdx.x = t;
        blockIdx.x = b;
        lenet_head(feat, w5t, b5, w6, b6, probs, B);
        if (!groups.empty() || !open_group.empty()) std::abort();  // copies left pending
      });
    for (auto& t : ts) t.join();
    for (int w = 0; w < HEAD_THREADS / 32; ++w) delete warp_bar[w];
  }
  char path[1024]; snprintf(path, sizeof path, "%s/out.bin", dir);
  FILE* f = fopen(path, "wb");
  fwrite(probs, 4, (size_t)(B + 16) * 10, f);
  fclose(f);
}
"""


def emulated_source(source: str) -> str:
    """The kernel without common.cuh: the emulator defines the cp.async wrappers it calls, and
    the kernel itself must hold no inline PTX."""
    out = source.replace('#include "common.cuh"', "")
    left = [ln for ln in out.splitlines() if "asm" in ln and not ln.lstrip().startswith("//")]
    assert not left, f"inline PTX the emulator does not know: {left}"
    return out


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("imgs", gnet.HEAD_IMGS_CHOICES)
def test_head_kernel_emulated_on_cpu(imgs: int, tmp_path: Path,
                                     rng: np.random.Generator) -> None:
    (tmp_path / "kernel.inc").write_text(emulated_source(KERNEL.read_text()))
    (tmp_path / "emu.cpp").write_text(EMU)
    exe = tmp_path / "emu"
    build = subprocess.run([str(GXX), "-std=c++20", "-O1", "-pthread", "-w",
                            *define_flags(gnet.head_defines(imgs)), "-o", str(exe),
                            str(tmp_path / "emu.cpp")], capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    p = random_head(rng)
    # (B, grid, late): one partial tile; several tiles a block; blocks with unequal tile counts
    for batch, grid, late in ((1, 1, 1), (imgs - 1, 1, 0), (imgs + 1, 2, 1),
                              (7 * imgs + 3, 3, 1), (9 * imgs, 4, 0)):
        feat = random_features(rng, batch)
        arrays = {"feat": feat, "w5t": np.ascontiguousarray(p["w5"].T), "b5": p["b5"],
                  "w6": p["w6"], "b6": p["b6"],
                  "probs": np.full((batch + 16, 10), np.nan, np.float32)}
        for name, a in arrays.items():
            a.astype(np.float32).tofile(tmp_path / f"{name}.bin")
        run = subprocess.run([str(exe), str(tmp_path), str(batch), str(grid), str(late)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (batch, grid, late, run.stderr[-2000:])
        got = np.fromfile(tmp_path / "out.bin", np.float32).reshape(batch + 16, 10)
        assert np.isnan(got[batch:]).all(), "wrote past B"
        assert np.isfinite(got[:batch]).all(), (batch, grid, late)
        assert np.abs(got[:batch] - head_fp64(feat, p)).max() <= 1e-5, (batch, grid, late)


# ---- on the GPU -------------------------------------------------------------------------------


def _device_head(cp: object, p: dict[str, np.ndarray]) -> tuple:
    d = {k: cp.asarray(v) for k, v in p.items()}  # type: ignore[attr-defined]
    return cp.ascontiguousarray(d["w5"].T), d["b5"], d["w6"], d["b6"]  # type: ignore[attr-defined]


@pytest.mark.gpu
@pytest.mark.parametrize("imgs", gnet.HEAD_IMGS_CHOICES)
@pytest.mark.parametrize("batch", [1, 31, 33, 1000, 10000, 10007])
def test_head_matches_fp64(imgs: int, batch: int, rng: np.random.Generator) -> None:
    import cupy as cp

    p = random_head(rng)
    w5t, b5, w6, b6 = _device_head(cp, p)
    feat = random_features(rng, batch)
    probs = cp.full((batch + 16, 10), cp.nan, cp.float32)  # 16 sentinel rows past B
    gnet.prepare_head(gnet.head_defines(imgs))(cp.asarray(feat), w5t, b5, w6, b6, probs)
    got = probs.get()
    assert np.isnan(got[batch:]).all(), "wrote past B"
    assert np.isfinite(got[:batch]).all()
    ref = head_fp64(feat, p)
    assert np.abs(got[:batch] - ref).max() <= 1e-5
    np.testing.assert_array_equal(got[:batch].argmax(1), ref.argmax(1))


@pytest.mark.gpu
@pytest.mark.parametrize("imgs", gnet.HEAD_IMGS_CHOICES)
def test_head_is_deterministic_and_per_image(imgs: int, rng: np.random.Generator) -> None:
    """Each image's sums run in a fixed order whatever its tile or block: the first 1000 images
    alone give the same bits as inside a batch of 5000, and a second launch repeats them."""
    import cupy as cp

    p = random_head(rng)
    args = _device_head(cp, p)
    head = gnet.prepare_head(gnet.head_defines(imgs))
    feat = cp.asarray(random_features(rng, 5000))
    full, again = cp.empty((5000, 10), cp.float32), cp.empty((5000, 10), cp.float32)
    part = cp.empty((1000, 10), cp.float32)
    head(feat, *args, full)
    head(feat, *args, again)
    head(feat[:1000], *args, part)
    np.testing.assert_array_equal(full.get(), again.get())
    np.testing.assert_array_equal(part.get(), full[:1000].get())


@pytest.mark.gpu
def test_head_rejects_strided_features(rng: np.random.Generator) -> None:
    import cupy as cp

    args = _device_head(cp, random_head(rng))
    head = gnet.prepare_head()
    feat = cp.asarray(random_features(rng, 64))
    with pytest.raises(ValueError, match="contiguous"):
        head(feat[::2], *args, cp.empty((32, 10), cp.float32))
    with pytest.raises(ValueError, match="contiguous"):
        head(feat[:, :512], *args, cp.empty((64, 10), cp.float32))
    head(feat[:0], *args, cp.empty((0, 10), cp.float32))  # B = 0: no launch


@pytest.mark.gpu
@pytest.mark.parametrize("imgs", gnet.HEAD_IMGS_CHOICES)
def test_fused_lenet_head_sizes_match_fp64(imgs: int, rng: np.random.Generator) -> None:
    import cupy as cp

    from convolab.gpu.network import FusedLeNet

    params = lenet_params(int(rng.integers(1 << 30)))
    x = rng.random((37, *conv_blocks("ece408")[0].shape.x_shape[1:])).astype(np.float32)
    net = FusedLeNet(params, mode="exact", kernel_params={"head": {"imgs": imgs}})
    probs = net(cp.asarray(x)).get()
    assert np.abs(probs - reference_forward(params, x)).max() <= 1e-5
