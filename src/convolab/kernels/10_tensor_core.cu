// Rung 10: tensor-core: implicit GEMM on the tensor cores through WMMA (nvcuda::wmma).
//
// What it adds over the fused (implicit) GEMM rung: the same GEMM view of convolution,
//   Y[m, n] = sum_k W[m, k] * X_unrolled[k, n],  k = (c, p, q),  n = (b, ho, wo),
// but the 16x16 tile products are done by warp-wide tensor-core instructions
// (mma_sync on 16x16xWK fragments) instead of scalar FMAs. The unrolled matrix is never
// built: each BK x BN tile of it is gathered from x straight into shared memory
// (converted to the operand type on the way), so global traffic is the input reads only.
//
// Operand modes (TC_MODE define, one registry entry each):
//   0 tf32   : fp32 in shared memory, rounded to TF32 (10-bit mantissa) in the fragments.
//              ~4e-4 relative error on random data; the registry promises 1e-3.
//   1 fp16   : operands stored as half (m16n16k16), fp32 accumulation. ~4e-4; promises 1e-2.
//   2 bf16   : operands as bfloat16 (7-bit mantissa, fp32 range). ~3e-3; promises 1e-2.
//   3 3xtf32 : each fp32 operand v is split into big = tf32(v) and small = tf32(v - big);
//              acc += a_small*b_big + a_big*b_small + a_big*b_big (the small*small term,
//              ~2^-22 relative, is dropped). Three MMAs per tile buy back fp32 accuracy
//              (the registry promises 1e-5) at three times the tensor-core work, which is
//              still cheap here because the gather, not the MMA, is the bottleneck. The
//              tensor cores' own fp32 accumulation truncates, which over C*K*K = 3136 terms
//              costs ~4e-5 (measured); so each BK-slice is accumulated from zero and added
//              into a separate fp32 fragment with ordinary round-to-nearest adds.
//
// Measured rel. L2 error vs fp64 on LeNet conv2 (random data): tf32 1.3e-4, fp16 1.3e-4,
// bf16 1.35e-3, 3xtf32 2.2e-7. Op Time at B=10000 (H100, tuned): conv2 bf16 2.27 ms,
// fp16 2.36, tf32 2.89, 3xtf32 4.26; conv1 (M=4, 3/4 of each MMA is padding) 4.2-7.6 ms.
//
// Block: WARPS warps side by side along n, each owning a 16 x (16*NFRAG) output tile; the
// block covers BM=16 output channels x BN = 16*NFRAG*WARPS output pixels. M is padded to
// 16 with zero weights (conv1 has M=4: three quarters of the MMA work is padding, which
// costs little since the layer is bound by memory, not by the tensor cores). The GEMM
// k-dimension C*K*K is padded to BK with zeros (conv2: 196 -> 208 or 224).
// Index arithmetic is kept out of the per-element path: each thread decodes its columns
// (b, ho, wo) once, and steps the input offset of its GEMM rows k = (c, p, q) incrementally
// (two integer divisions per element were the first version's bottleneck). With PREFETCH,
// the next k-slice is loaded into registers while the tensor cores work on the current
// one (software pipelining: global-load latency hidden behind MMAs); measured on H100 it
// gains nothing here (2.83 vs 2.84 ms, conv2 fp16), the L1-resident gather being bound by
// instruction throughput rather than latency, so the tuner leaves it off. Epilogue:
// accumulators go through shared memory so that the bias
// add and the scatter to NCHW y are coalesced along wo.

#include <mma.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef TC_MODE
#define TC_MODE 0
#endif
#ifndef NFRAG
#define NFRAG 2  // 16-wide fragments per warp along n
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef BK
#define BK 32  // k-slice per shared-memory stage; a multiple of 16
#endif
#ifndef PREFETCH
#define PREFETCH 1  // load the next k-slice into registers during the current one's MMAs
#endif

using namespace nvcuda;

#if TC_MODE == 1
typedef __half elem_t;
typedef half frag_t;
#define WK 16
#define PAD 8
__device__ __forceinline__ elem_t to_elem(float v) { return __float2half_rn(v); }
#elif TC_MODE == 2
typedef __nv_bfloat16 elem_t;
typedef __nv_bfloat16 frag_t;
#define WK 16
#define PAD 8
__device__ __forceinline__ elem_t to_elem(float v) { return __float2bfloat16_rn(v); }
#else
typedef float elem_t;
typedef wmma::precision::tf32 frag_t;
#define WK 8
#define PAD 4
__device__ __forceinline__ elem_t to_elem(float v) { return v; }
#endif

#define BM 16
#define THREADS (WARPS * 32)
#define BN (16 * NFRAG * WARPS)
#define LDA (BK + PAD)
#define LDB (BN + PAD)
#define LDC (BN + 4)
#define COLS_PER_THREAD ((BN >= THREADS) ? (BN / THREADS) : 1)
#define ROW_STEP ((BN >= THREADS) ? 1 : (THREADS / BN))

#if BK % 16 != 0
#error "BK must be a multiple of 16"
#endif

#define A_BYTES (BM * LDA * sizeof(elem_t))
#define B_BYTES (BK * LDB * sizeof(elem_t))
#define C_BYTES (BM * LDC * sizeof(float))
#define AB_BYTES (((A_BYTES + 127) / 128) * 128 + B_BYTES)
#define SMEM_BYTES (AB_BYTES > C_BYTES ? AB_BYTES : C_BYTES)

typedef wmma::fragment<wmma::matrix_a, 16, 16, WK, frag_t, wmma::row_major> frag_a;
typedef wmma::fragment<wmma::matrix_b, 16, 16, WK, frag_t, wmma::row_major> frag_b;
typedef wmma::fragment<wmma::accumulator, 16, 16, WK, float> frag_acc;

extern "C" __global__ void __launch_bounds__(THREADS)
conv_tensor_core(const float* __restrict__ x, const float* __restrict__ w,
                 const float* __restrict__ bias, float* __restrict__ y,
                 int B, int C, int H, int W, int M, int K, int S, int Ho, int Wo) {
    __shared__ __align__(128) unsigned char smem[SMEM_BYTES];
    elem_t* As = reinterpret_cast<elem_t*>(smem);
    elem_t* Bs = reinterpret_cast<elem_t*>(smem + ((A_BYTES + 127) / 128) * 128);
    float* Cs = reinterpret_cast<float*>(smem);  // reused after the k loop

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int kk_size = K * K;
    const int ckk = C * kk_size;
    const int n_pix = Ho * Wo;
    const long long n_total = (long long)B * n_pix;
    const long long n0 = (long long)blockIdx.x * BN;
    const int m0 = blockIdx.y * BM;

    // Which columns (output pixels) this thread gathers, decoded once.
    const int col_base = tid % BN;
    const int row_start = (BN >= THREADS) ? 0 : tid / BN;
    size_t col_off[COLS_PER_THREAD];
    bool col_ok[COLS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < COLS_PER_THREAD; ++j) {
        const long long n = n0 + col_base + j * THREADS;
        col_ok[j] = n < n_total;
        const long long nn = col_ok[j] ? n : 0;
        const int b = (int)(nn / n_pix);
        const int pix = (int)(nn - (long long)b * n_pix);
        const int ho = pix / Wo, wo = pix - (pix / Wo) * Wo;
        col_off[j] = ((size_t)b * C * H + (size_t)ho * S) * W + (size_t)wo * S;
    }

    frag_acc acc[NFRAG];
#pragma unroll
    for (int f = 0; f < NFRAG; ++f) wmma::fill_fragment(acc[f], 0.0f);
#if TC_MODE == 3
    // The tensor cores' fp32 accumulation is not round-to-nearest (products are aligned and
    // truncated), so a chain over thousands of k loses ~1e-5. Each k-slice therefore starts
    // from zero in `acc` and is added here with ordinary fp32 adds.
    frag_acc total[NFRAG];
#pragma unroll
    for (int f = 0; f < NFRAG; ++f) wmma::fill_fragment(total[f], 0.0f);
#endif

    // The GEMM rows this thread gathers are k = row_start, row_start + ROW_STEP, ... across
    // all k-slices, so their input offsets (c*H + p)*W + q are stepped incrementally: no
    // integer division in the loop and no shared table to synchronise on.
    int k_next = row_start;
    int q_next = row_start % K, p_next = (row_start / K) % K;
    int off_next = ((row_start / kk_size) * H + p_next) * W + q_next;
    // Values of the next k-slice, loaded before the current slice's MMAs so that the
    // global-load latency overlaps tensor-core work (PREFETCH=1), or loaded just in time.
    float staged[BK / ROW_STEP][COLS_PER_THREAD];

    auto gather_slice = [&]() {
#pragma unroll
        for (int i = 0; i < BK / ROW_STEP; ++i) {
            const bool k_ok = k_next < ckk;
#pragma unroll
            for (int j = 0; j < COLS_PER_THREAD; ++j)
                staged[i][j] = (k_ok && col_ok[j]) ? x[col_off[j] + off_next] : 0.0f;
#pragma unroll
            for (int step = 0; step < ROW_STEP; ++step) {
                ++k_next;
                ++q_next;
                ++off_next;
                if (q_next == K) {
                    q_next = 0;
                    off_next += W - K;
                    if (++p_next == K) {
                        p_next = 0;
                        off_next += (H - K) * W;
                    }
                }
            }
        }
    };

#if PREFETCH
    gather_slice();
#endif
    for (int k0 = 0; k0 < ckk; k0 += BK) {
#if !PREFETCH
        gather_slice();
#endif
        // A tile: BM x BK weights, zero beyond M and C*K*K.
        for (int i = tid; i < BM * BK; i += THREADS) {
            const int r = i / BK, kcol = i - (i / BK) * BK;
            const int m = m0 + r, k = k0 + kcol;
            As[r * LDA + kcol] = to_elem((m < M && k < ckk) ? w[(size_t)m * ckk + k] : 0.0f);
        }
        // B tile: the staged BK x BN slice of the implicit im2col matrix.
#pragma unroll
        for (int i = 0; i < BK / ROW_STEP; ++i)
#pragma unroll
            for (int j = 0; j < COLS_PER_THREAD; ++j)
                Bs[(row_start + i * ROW_STEP) * LDB + col_base + j * THREADS] =
                    to_elem(staged[i][j]);
        __syncthreads();
#if PREFETCH
        if (k0 + BK < ckk) gather_slice();
#endif

#pragma unroll
        for (int ks = 0; ks < BK; ks += WK) {
            frag_a a;
            wmma::load_matrix_sync(a, As + ks, LDA);
#if TC_MODE == 3
            frag_a a_small;
#pragma unroll
            for (int i = 0; i < a.num_elements; ++i) {
                const float v = a.x[i];
                const float big = wmma::__float_to_tf32(v);
                a.x[i] = big;
                a_small.x[i] = wmma::__float_to_tf32(v - big);
            }
#elif TC_MODE == 0
#pragma unroll
            for (int i = 0; i < a.num_elements; ++i) a.x[i] = wmma::__float_to_tf32(a.x[i]);
#endif
#pragma unroll
            for (int f = 0; f < NFRAG; ++f) {
                frag_b bf;
                wmma::load_matrix_sync(bf, Bs + ks * LDB + (warp * NFRAG + f) * 16, LDB);
#if TC_MODE == 3
                frag_b b_small;
#pragma unroll
                for (int i = 0; i < bf.num_elements; ++i) {
                    const float v = bf.x[i];
                    const float big = wmma::__float_to_tf32(v);
                    bf.x[i] = big;
                    b_small.x[i] = wmma::__float_to_tf32(v - big);
                }
                wmma::mma_sync(acc[f], a_small, bf, acc[f]);
                wmma::mma_sync(acc[f], a, b_small, acc[f]);
#elif TC_MODE == 0
#pragma unroll
                for (int i = 0; i < bf.num_elements; ++i) bf.x[i] = wmma::__float_to_tf32(bf.x[i]);
#endif
                wmma::mma_sync(acc[f], a, bf, acc[f]);
            }
        }
#if TC_MODE == 3
#pragma unroll
        for (int f = 0; f < NFRAG; ++f) {
#pragma unroll
            for (int i = 0; i < acc[f].num_elements; ++i) total[f].x[i] += acc[f].x[i];
            wmma::fill_fragment(acc[f], 0.0f);
        }
#endif
        __syncthreads();
    }
#if TC_MODE == 3
#pragma unroll
    for (int f = 0; f < NFRAG; ++f) acc[f] = total[f];
#endif

#pragma unroll
    for (int f = 0; f < NFRAG; ++f)
        wmma::store_matrix_sync(Cs + (warp * NFRAG + f) * 16, acc[f], LDC, wmma::mem_row_major);
    __syncthreads();

#pragma unroll
    for (int j = 0; j < COLS_PER_THREAD; ++j) {
        const int col = col_base + j * THREADS;
        const long long n = n0 + col;
        if (n >= n_total) continue;
        const int b = (int)(n / n_pix);
        const size_t y_off = (size_t)b * M * n_pix + (size_t)(n - (long long)b * n_pix);
        for (int r = row_start; r < BM; r += ROW_STEP) {
            const int m = m0 + r;
            if (m < M) y[y_off + (size_t)m * n_pix] = Cs[r * LDC + col] + bias[m];
        }
    }
}
