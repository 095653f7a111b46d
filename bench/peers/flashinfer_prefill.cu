// FlashInfer 0.7.2 single-request prefill (FA2 path), instantiated as its JIT would for f16
// q/kv/o, head_dim 128, causal mask, no RoPE, f32 QK accumulation. The Params struct is
// single_prefill_customize_config.jinja rendered with the values flashinfer/jit/attention/
// modules.py passes for the fa2 backend; the kernel traits are the ones
// SinglePrefillWithKVCacheDispatched (attention/prefill.cuh) derives for qo_len 4096 on sm_80
// and sm_90, spelled out below so only this one kernel is compiled:
//   FA2DetermineCtaTileQ(4096 x group, 128) = 128 -> NUM_WARPS_Q 4, NUM_WARPS_KV 1, NUM_MMA_Q 2;
//   K+V smem per NUM_MMA_KV = (128 + 128) x 16 x 2 B = 8 KiB, fixed (Q tile) 32 KiB; two CTAs
//   fit an SM (sm_80 164 KiB, sm_90 228 KiB), so <= 82 (114) KiB per CTA allows 6 (10) NUM_MMA_KV;
//   the register cap 8 / NUM_MMA_Q = 4 binds -> NUM_MMA_KV 4 (64 KV rows per tile), 64 KiB smem.
#include <flashinfer/math.cuh>
#include <flashinfer/layout.cuh>
#include <flashinfer/utils.cuh>
#include <flashinfer/pos_enc.cuh>
#include <flashinfer/fastdiv.cuh>
#include <flashinfer/attention/variant_helper.cuh>

using namespace flashinfer;

using DTypeQ = half;
using DTypeKV = half;
using DTypeO = half;
using IdType = int32_t;

struct Params {
  using DTypeQ = DTypeQ;
  using DTypeKV = DTypeKV;
  using DTypeO = DTypeO;
  using IdType = int32_t;
  DTypeQ* q;
  DTypeKV* k;
  DTypeKV* v;
  DTypeO* o;
  float* lse;
  uint_fastdiv group_size;

  uint8_t* maybe_custom_mask;
  float* maybe_alibi_slopes;
  uint8_t* maybe_k_cache_sf;
  uint8_t* maybe_v_cache_sf;
  double logits_soft_cap;
  double sm_scale;
  double rope_rcp_scale;
  double rope_rcp_theta;

  uint32_t qo_len;
  uint32_t kv_len;
  uint32_t num_qo_heads;
  uint32_t num_kv_heads;
  uint32_t q_stride_n;
  uint32_t q_stride_h;
  uint32_t k_stride_n;
  uint32_t k_stride_h;
  uint32_t v_stride_n;
  uint32_t v_stride_h;
  uint32_t head_dim;
  int32_t window_left;

  bool partition_kv;

  __host__ __device__ __forceinline__ uint32_t get_qo_len(uint32_t batch_idx) const {
    return qo_len;
  }

  __host__ __device__ __forceinline__ uint32_t get_kv_len(uint32_t batch_idx) const {
    return kv_len;
  }
};

#include <flashinfer/attention/variants.cuh>
#include <flashinfer/attention/prefill.cuh>

namespace flashinfer {

using Variant = DefaultAttention</*use_custom_mask=*/false, false, false, false>;
constexpr uint32_t kCtaTileQ = 128, kNumMmaQ = 2, kNumMmaKV = 4, kWarpsQ = 4, kWarpsKV = 1;
static_assert(get_num_warps_q(kCtaTileQ) == kWarpsQ && get_num_warps_kv(kCtaTileQ) == kWarpsKV &&
              get_num_mma_q(kCtaTileQ) == kNumMmaQ);
using KTraits = KernelTraits<MaskMode::kCausal, kCtaTileQ, kNumMmaQ, kNumMmaKV, 128 / 16, 128 / 16,
                             kWarpsQ, kWarpsKV, PosEncodingMode::kNone, DTypeQ, DTypeKV, DTypeO,
                             float, IdType, Variant, kPrefillLauncherRepacksFp4>;
static_assert(!KTraits::IsInvalid());
static_assert(sizeof(typename KTraits::SharedStorage) == 64 * 1024);

template __global__ void SinglePrefillWithKVCacheKernel<KTraits, Params>(
    const __grid_constant__ Params params);

}  // namespace flashinfer
