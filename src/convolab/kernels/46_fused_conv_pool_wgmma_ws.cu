// Rung 46 — rung 44 warp-specialized: a producer warpgroup stages the next image while two (or
// three) consumer warpgroups run rung 44's MMA loop (fused_wgmma_loop.cuh) on this one.
//
// Why. In rung 44 the warps that issue the wgmmas also stage each image (load it, scale it,
// split it into fp16 parts): while one block of an SM stages, only the other issues MMAs, and a
// lone warpgroup reaches about half the tensor rate. Staging once and computing the same image
// over and over took eecs498's conv2 from 779 to 686 us (3xfp16) and 356 to 288 (fp16) on the
// H200 (docs/raw.md, "Rung 46"): that is the time this rung moves off the MMA warps.
//   * The producer asks the bulk copy engine for the next image's bytes (one cp.async.bulk of
//     the image's 16-byte granules into a raw buffer, completing on an mbarrier), then converts
//     them into one of two staged-image slots (rung 44's form: HWC, fp16 hi and lo parts of the
//     image times its power-of-two scale) and issues the copy after it.
//   * Named barriers hand a slot over: FULL (the producer arrives, the consumers wait) and
//     EMPTY (the consumers arrive after the image's last m-tile, the producer waits before it
//     stages into the slot again).
//   * setmaxnreg moves registers from the producer to the consumers (the MMA loop keeps its
//     ring of A quads in registers): 224 a consumer thread with two consumer warpgroups, 152
//     with three (FW_WGS = 3, where the loop fits at ring 4 with one sum).
// Same MMAs in the same order as rung 44, same scale exponents: the outputs are bit-identical.
// FWS_STAGED_IN 1: the input is already in the staged form (records of both parts and the
// image's scale exponent, as rung 45 writes them with FR_STG), so the producer only copies a
// record into a slot, which completes on that slot's mbarrier.

#ifndef FW_PREC
#define FW_PREC 3
#endif
#ifndef FW_WGS
#define FW_WGS 2  // consumer warpgroups
#endif
#ifndef FW_RING
#define FW_RING 5  // rung 44's parameters of the MMA loop
#endif
#ifndef FW_LEAD
#define FW_LEAD 2
#endif
#ifndef FW_SUM
#define FW_SUM 2
#endif
#define FW_WARPS (4 * FW_WGS)
#define FW_UNITS 1
#include "fused_wide.cuh"
#if FW_PREC == 3
#include "fused_wide_split.cuh"
#else
#include "fused_wide_single.cuh"
#endif
#include "fused_wide_stage.cuh"
#include "mbarrier.cuh"
#include "warp_roles.cuh"
#include "wgmma_core.cuh"
#include "wgmma_rs.cuh"

#include "fused_wgmma.cuh"
#include "fused_wgmma_loop.cuh"

#define FWS_PRODUCERS 128
#define FWS_THREADS (FW_THREADS + FWS_PRODUCERS)
#ifndef FWS_PRODUCER_REGS
#define FWS_PRODUCER_REGS 56
#endif
#ifndef FWS_CONSUMER_REGS  // what the SM's 64K registers leave the consumers
#define FWS_CONSUMER_REGS ((65536 - FWS_PRODUCERS * FWS_PRODUCER_REGS) / FW_THREADS / 8 * 8)
#endif
static_assert(FWS_PRODUCERS * FWS_PRODUCER_REGS + FW_THREADS * FWS_CONSUMER_REGS <= 65536,
              "rung 46: the registers the roles ask for exceed the SM's");
#ifndef FWS_STAGED_IN
#define FWS_STAGED_IN 0
#endif
// A raw image: its 16-byte granules (the first may start up to 15 bytes before it).
#define FWS_RAW_BYTES ((FW_RAW_BYTES + 15) / 16 * 16 + 16)
#define FWS_SLOT_BYTES (FW_PARTS * FW_IMG1_BYTES)
// A staged record: the slot's bytes (hi part, lo part), then 16 bytes whose first int is the
// image's scale exponent.
#define FWS_REC_BYTES (FWS_SLOT_BYTES + 16)
#if FWS_STAGED_IN
// [align][weights][record 0][record 1][mbarriers 2 x 8]
#define FWS_SMEM_BYTES (FW_ALIGN + FW_B_BYTES + 2 * FWS_REC_BYTES + 16)
static_assert(FW_PREC == 3, "rung 46: staged records are 3xfp16's");
#else
// [align][weights][slot 0][slot 1][raw][mbarrier 8][exponents 2 x 4][producer maxima 4 x 4]
#define FWS_TAIL_BYTES 32
#define FWS_SMEM_BYTES (FW_ALIGN + FW_B_BYTES + 2 * FWS_SLOT_BYTES + FWS_RAW_BYTES + FWS_TAIL_BYTES)
#endif
enum { kBarProducers = 1, kBarFull = 2, kBarEmpty = 4 };  // kBarFull + slot, kBarEmpty + slot

// Image b's granules into raw, completing on bar (one thread).
__device__ __forceinline__ void fws_fetch(unsigned raw, const fw_in_t* x, int b, unsigned bar) {
  const char* first = reinterpret_cast<const char*>(x + (size_t)b * (FW_C * FW_H * FW_W));
  const size_t lo = reinterpret_cast<size_t>(first) & ~(size_t)15;
  const size_t hi = (reinterpret_cast<size_t>(first) + FW_RAW_BYTES + 15) & ~(size_t)15;
  mbar_expect_tx(bar, (unsigned)(hi - lo));
  bulk_copy(raw, reinterpret_cast<const void*>(lo), (unsigned)(hi - lo), bar);
}

// Where image b's first element sits in the raw buffer.
__device__ __forceinline__ const fw_in_t* fws_image(const unsigned char* raw, const fw_in_t* x,
                                                    int b) {
  const size_t at = reinterpret_cast<size_t>(x + (size_t)b * (FW_C * FW_H * FW_W));
  return reinterpret_cast<const fw_in_t*>(raw + (at & 15));
}

// The raw image (NCHW in shared memory) -> img (rung 44's staged form), by the producer's 128
// threads (pt its thread); returns the image's scale exponent (fw_stage_once's, 0 in fp16).
__device__ __forceinline__ int fws_stage(fw_t* img, const fw_in_t* raw, float* red, int pt) {
  constexpr int PIX = FW_H * FW_W, ITEMS = PIX * (FW_CS / 4);
  int e = 0;
#if FW_PREC == 3
  float m = 0.f;
#pragma unroll 4
  for (int i = pt; i < FW_C * PIX; i += FWS_PRODUCERS) m = fmaxf(m, fabsf(fw_in<true>(raw + i)));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((pt & 31) == 0) red[pt >> 5] = m;
  bar_sync(kBarProducers, FWS_PRODUCERS);
  e = fw_scale_exponent(fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3])));
#endif
  const float scale = fw_pow2(e);
#pragma unroll 2
  for (int i = pt; i < ITEMS; i += FWS_PRODUCERS) {
    const int quad = i / PIX, pix = i - quad * PIX;
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int c = 4 * quad + k;
      v[k] = c < FW_C ? fw_in<true>(raw + c * PIX + pix) : 0.f;
    }
    const int row_pad = (pix / FW_W) * (FW_WS - FW_W);
    fw_store4(img + (pix + row_pad) * FW_CS + 4 * quad, v, scale);
  }
  return e;
}

#if FWS_STAGED_IN
// The same persistent loop fed by staged records (x: B records of FWS_REC_BYTES): the
// producer's first thread copies record b into slot i % 2 (mbarrier i % 2), the consumers wait
// on that mbarrier and read the exponent from the record's tail.
extern "C" __global__ void __launch_bounds__(FWS_THREADS, 1)
fcp_wgmma_ws(const fw_in_t* __restrict__ x, const uint4* __restrict__ wpack,
             const float* __restrict__ bias, float* __restrict__ y, int batch, float w_unscale) {
  extern __shared__ __align__(16) unsigned char fw_smem[];
  unsigned wsm;
  unsigned char* wsm_p = fw_aligned(fw_smem, wsm);
  const unsigned char* rec = reinterpret_cast<const unsigned char*>(x);
  const unsigned slots_s = wsm + FW_B_BYTES, bars = slots_s + 2 * FWS_REC_BYTES;
  for (int i = threadIdx.x; i < FW_B_BYTES / 16; i += FWS_THREADS)
    reinterpret_cast<uint4*>(wsm_p)[i] = __ldg(wpack + i);
  wg_proxy_fence();  // the wgmmas read the weights through the async proxy
  if (threadIdx.x == 0) {
    mbar_init(bars, 1);
    mbar_init(bars + 8, 1);
    fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x >= FW_THREADS) {  // the producer warpgroup: its first thread copies
    set_max_regs_dec<FWS_PRODUCER_REGS>();
    int i = 0;
    for (int b = blockIdx.x; b < batch; b += gridDim.x, ++i) {
      const int slot = i & 1;
      if (i >= 2) bar_sync(kBarEmpty + slot, FWS_THREADS);  // image i - 2 is done with it
      if (threadIdx.x == FW_THREADS) {
        wg_proxy_fence();  // the copy engine overwrites what generic loads read
        mbar_expect_tx(bars + 8 * slot, FWS_REC_BYTES);
        bulk_copy(slots_s + slot * FWS_REC_BYTES, rec + (size_t)b * FWS_REC_BYTES,
                  FWS_REC_BYTES, bars + 8 * slot);
      }
    }
  } else {  // the consumer warpgroups: rung 44's loop and store
    set_max_regs_inc<FWS_CONSUMER_REGS>();
    const unsigned long long d0 = fw_b0(wsm);
    int i = 0;
    for (int b = blockIdx.x; b < batch; b += gridDim.x, ++i) {
      const int slot = i & 1;
      mbar_wait(bars + 8 * slot, (i >> 1) & 1);
      const unsigned char* rec_s = wsm_p + FW_B_BYTES + slot * FWS_REC_BYTES;
      const fw_t* img = reinterpret_cast<const fw_t*>(rec_s);
      const float a_unscale = fw_pow2(-*reinterpret_cast<const int*>(rec_s + FWS_SLOT_BYTES));
      fws_consume(img, d0, bias, y, b, i, w_unscale, a_unscale);
      if (b + 2 * (int)gridDim.x < batch) bar_arrive(kBarEmpty + slot, FWS_THREADS);
    }
  }
}
#else
// Persistent, one block an SM: the block copies the packed weights once; its images are
// blockIdx.x, + gridDim.x, ...; the i-th of them goes through slot i % 2.
extern "C" __global__ void __launch_bounds__(FWS_THREADS, 1)
fcp_wgmma_ws(const fw_in_t* __restrict__ x, const uint4* __restrict__ wpack,
             const float* __restrict__ bias, float* __restrict__ y, int batch, float w_unscale) {
  extern __shared__ __align__(16) unsigned char fw_smem[];
  unsigned wsm;
  unsigned char* wsm_p = fw_aligned(fw_smem, wsm);
  fw_t* slots = reinterpret_cast<fw_t*>(wsm_p + FW_B_BYTES);
  unsigned char* raw = wsm_p + FW_B_BYTES + 2 * FWS_SLOT_BYTES;
  unsigned char* tail = raw + FWS_RAW_BYTES;
  const unsigned bar = wsm + (unsigned)(tail - wsm_p);
  int* exps = reinterpret_cast<int*>(tail + 8);
  float* red = reinterpret_cast<float*>(tail + 16);
  for (int i = threadIdx.x; i < FW_B_BYTES / 16; i += FWS_THREADS)
    reinterpret_cast<uint4*>(wsm_p)[i] = __ldg(wpack + i);
  wg_proxy_fence();  // the wgmmas read the weights through the async proxy
  fw_zero_slack(slots);
  fw_zero_slack(slots + FWS_SLOT_BYTES / FW_ESIZE);
  if (threadIdx.x == 0) {
    mbar_init(bar, 1);
    fence_barrier_init();
  }
  __syncthreads();
  const int slot_elems = FWS_SLOT_BYTES / FW_ESIZE;

  if (threadIdx.x >= FW_THREADS) {  // the producer warpgroup
    set_max_regs_dec<FWS_PRODUCER_REGS>();
    const int pt = threadIdx.x - FW_THREADS;
    const unsigned raw_s = wsm + (unsigned)(raw - wsm_p);
    if (pt == 0 && (int)blockIdx.x < batch) fws_fetch(raw_s, x, blockIdx.x, bar);
    int i = 0;
    for (int b = blockIdx.x; b < batch; b += gridDim.x, ++i) {
      const int slot = i & 1;
      mbar_wait(bar, i & 1);  // image b's bytes have landed
      if (i >= 2) bar_sync(kBarEmpty + slot, FWS_THREADS);  // image i - 2 is done with the slot
      const int e = fws_stage(slots + slot * slot_elems, fws_image(raw, x, b), red, pt);
      bar_sync(kBarProducers, FWS_PRODUCERS);  // every producer thread is done with raw and red
      if (pt == 0) {
        exps[slot] = e;
        if (b + (int)gridDim.x < batch) {
          wg_proxy_fence();  // the copy engine overwrites what generic loads just read
          fws_fetch(raw_s, x, b + gridDim.x, bar);
        }
      }
      bar_arrive(kBarFull + slot, FWS_THREADS);
    }
  } else {  // the consumer warpgroups: rung 44's loop and store
    set_max_regs_inc<FWS_CONSUMER_REGS>();
    const unsigned long long d0 = fw_b0(wsm);
    int i = 0;
    for (int b = blockIdx.x; b < batch; b += gridDim.x, ++i) {
      const int slot = i & 1;
      bar_sync(kBarFull + slot, FWS_THREADS);
      const fw_t* img = slots + slot * slot_elems;
      const float a_unscale = fw_pow2(-exps[slot]);
      fws_consume(img, d0, bias, y, b, i, w_unscale, a_unscale);
      // The producer waits for this slot only where it has an image i + 2 to stage in it.
      if (b + 2 * (int)gridDim.x < batch) bar_arrive(kBarEmpty + slot, FWS_THREADS);
    }
  }
}
#endif
