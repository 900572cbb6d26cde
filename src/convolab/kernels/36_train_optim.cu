// Training rung 36 — the optimizer step over every parameter in one launch: each gradient is
// the fixed-order sum of the batch slices' partials (kernels 33-35), then Adam or SGD with
// momentum updates the flat parameter buffer in place.
//
// Against optim.py on the GPU (per parameter tensor ~8 CuPy element-wise kernels, plus a
// CuPy reduction per partial-sum buffer): one launch, each gradient read once. The learning
// rate and Adam's bias corrections come from a per-step table the host computes in float64
// (`sched`, 2 floats per step), indexed by the device's step counter, so a captured step graph
// needs no host value per step. Also here: the two bookkeeping kernels of the epoch graph.
//
// Measured (H100, 2026-11-25): 0.02 ms a step (36,482 parameters; partials of 32-512 slices).

#ifndef OPT_THREADS
#define OPT_THREADS 256
#endif

// One segment per layer: its weights then biases, contiguous in the parameter buffer.
struct Segment {
  int param_off, size, part_off, slices;
};

constexpr int ADAM = 0, SGD = 1, GRAD_ONLY = 2;  // GRAD_ONLY: sum into grad_out, no update

extern "C" __global__ void __launch_bounds__(OPT_THREADS)
train_optim(float* __restrict__ params, float* __restrict__ mom1, float* __restrict__ mom2,
            const float* __restrict__ part, const Segment* __restrict__ segs, int n_segs,
            int n_params, const float* __restrict__ sched, const int* __restrict__ step_base,
            int step, int mode, float beta1, float beta2, float eps, float weight_decay,
            float* __restrict__ grad_out) {
  const int i = blockIdx.x * OPT_THREADS + threadIdx.x;
  if (i >= n_params) return;
  int s = 0;
  while (s + 1 < n_segs && i >= segs[s + 1].param_off) ++s;
  const Segment seg = segs[s];
  const int j = i - seg.param_off;
  float g = 0.f;
  for (int k = 0; k < seg.slices; ++k)
    g += part[seg.part_off + static_cast<size_t>(k) * seg.size + j];
  if (grad_out) grad_out[i] = g;
  if (mode == GRAD_ONLY) return;
  float p = params[i];
  if (weight_decay != 0.f) g = fmaf(weight_decay, p, g);  // L2 through the moments (optim.py)
  const int t = *step_base + step;
  const float lr = sched[2 * t];
  if (mode == ADAM) {
    const float m = beta1 * mom1[i] + (1.f - beta1) * g;
    const float v = beta2 * mom2[i] + (1.f - beta2) * g * g;
    mom1[i] = m, mom2[i] = v;
    p -= lr * m / (sqrtf(v * sched[2 * t + 1]) + eps);  // lr already holds 1/(1-beta1^t)
  } else if (mode == SGD) {
    const float v = beta1 * mom1[i] + g;  // beta1: the momentum
    mom1[i] = v;
    p -= lr * v;
  }
  params[i] = p;
}

// End of an epoch graph: the step counter moves on, and the mirror salt (when on) changes.
extern "C" __global__ void train_advance(int* __restrict__ step_base,
                                         unsigned* __restrict__ salt, int steps) {
  *step_base += steps;
  if (*salt != 0u) *salt = (*salt * 1664525u + 1013904223u) | 1u;
}

// Zero n words (the running loss and correct-count sums) inside a captured graph.
extern "C" __global__ void train_clear(unsigned* __restrict__ words, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) words[i] = 0u;
}
