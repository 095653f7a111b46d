// FlashInfer 0.7.2 single-request prefill, FA3 path (sm_90a: TMA, wgmma, warp-specialised
// producer/consumer warpgroups; what FlashInfer runs on H100 by default), instantiated as its JIT
// would for f16 q/kv/o, head_dim 128, causal, no sliding window, no soft-cap: the Params struct
// is single_prefill_sm90_customize_config.jinja rendered with the values
// flashinfer/jit/attention/modules.py passes for the fa3 backend, and the explicit instantiation
// is single_prefill_sm90_kernel_inst.jinja's (SinglePrefillWithKVCacheDispatched is resolved at
// compile time: one kernel, CTA tile from getCTATileSize<128, 128, causal>, 2 stages).
#include <flashinfer/attention/hopper/attention_updater.cuh>
#include <flashinfer/attention/hopper/variant_helper.cuh>
#include <flashinfer/math.cuh>
#include <flashinfer/layout.cuh>
#include <flashinfer/cutlass_utils.cuh>
#include <flashinfer/utils.cuh>
#include <flashinfer/pos_enc.cuh>

using namespace flashinfer;

using DTypeQ = cutlass_dtype_t<half>;
using DTypeKV = cutlass_dtype_t<half>;
using DTypeO = cutlass_dtype_t<half>;
using IdType = cutlass_dtype_t<int32_t>;

struct Params {
  using DTypeQ = DTypeQ;
  using DTypeKV = DTypeKV;
  using DTypeO = DTypeO;
  using IdType = IdType;

  DTypeQ* q_ptr;
  DTypeKV* k_ptr;
  DTypeKV* v_ptr;
  DTypeO* o_ptr;
  float* lse_ptr;

  struct AdditionalParams {
    float* maybe_scale_v;
    double logits_soft_cap;
    double sm_scale;
    double scale_v_scalar;
  } additional_params;

  int64_t q_stride_n;
  int64_t k_stride_n;
  int64_t v_stride_n;
  int64_t o_stride_n;
  int64_t q_stride_h;
  int64_t k_stride_h;
  int64_t v_stride_h;
  int64_t o_stride_h;

  int qo_len;
  int kv_len;
  int head_dim;
  int num_qo_heads;
  int num_kv_heads;
  int group_size;
  int window_left;

  bool causal;
};

#include <flashinfer/attention/hopper/variants.cuh>
#include <flashinfer/attention/hopper/prefill_sm90.cuh>

namespace flashinfer {

// what the dispatcher launches with: CTA 128 x 128, 2 stages; 3 warpgroups (1 producer, 2
// consumers); sizeof(SharedStorage) bytes of dynamic shared memory
using FA3Traits = AttentionKernelTraits<true, 128, 128, 128, 128, 2, DTypeQ, DTypeKV, DTypeO, IdType,
                                        DefaultAttention<false>>;
static_assert(std::get<0>(getCTATileSize<128, 128, true>()) == 128 &&
              std::get<1>(getCTATileSize<128, 128, true>()) == 128);
static_assert(FA3Traits::NUM_THREADS == 384);
static_assert(sizeof(typename FA3Traits::SharedStorage) == 163920);

template cudaError_t SinglePrefillWithKVCacheDispatched<128, 128, MaskMode::kCausal,
                                                        /*USE_SLIDING_WINDOW=*/false,
                                                        DefaultAttention<false>, Params>(
    Params& params, cudaStream_t stream);

}  // namespace flashinfer
