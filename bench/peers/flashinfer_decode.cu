// FlashInfer 0.7.2 batch decode over a paged KV cache, instantiated as its JIT would for
// f16 q/kv/o, head_dim 128, GQA 32/8 (group 4), no RoPE, no sliding window, no soft-cap.
// The Params struct is batch_decode_customize_config.jinja rendered with the values
// flashinfer/jit/attention/modules.py passes for the default decode module (the
// additional tensors/scalars of DefaultAttention); the kernel's template arguments are the ones
// BatchDecodeWithPagedKVCacheDispatched (attention/decode.cuh) derives, spelled out below so
// only this one kernel is compiled (the dispatcher would instantiate every group size).
#include <flashinfer/page.cuh>
#include <flashinfer/math.cuh>
#include <flashinfer/layout.cuh>
#include <flashinfer/pos_enc.cuh>
#include <flashinfer/attention/variant_helper.cuh>

using namespace flashinfer;

using DTypeQ = half;
using DTypeKV = half;
using DTypeO = half;
using IdType = int32_t;
constexpr int HEAD_DIM_QK = 128;
constexpr int HEAD_DIM_VO = 128;
constexpr auto USE_LOGITS_SOFT_CAP = false;
constexpr auto POS_ENCODING_MODE = PosEncodingMode::kNone;
constexpr auto USE_SLIDING_WINDOW = false;

struct Params {
  using DTypeQ = DTypeQ;
  using DTypeKV = DTypeKV;
  using DTypeO = DTypeO;
  using IdType = IdType;

  DTypeQ* q;
  paged_kv_t<DTypeKV, IdType> paged_kv;
  DTypeO* o;
  float* lse;

  float* maybe_alibi_slopes;
  double logits_soft_cap;
  double sm_scale;
  double rope_rcp_scale;
  double rope_rcp_theta;

  uint32_t padded_batch_size;
  uint32_t num_qo_heads;
  IdType q_stride_n;
  IdType q_stride_h;
  int32_t window_left;
  bool enable_pdl;

  IdType* request_indices;
  IdType* kv_tile_indices;
  IdType* o_indptr;
  IdType* kv_chunk_size_ptr;
  bool* block_valid_mask;
  bool partition_kv;

  __host__ __device__ __forceinline__ int32_t get_qo_len(int32_t batch_idx) const { return 1; }

  __host__ __device__ __forceinline__ int32_t get_kv_len(int32_t batch_idx) const {
    return paged_kv.get_length(batch_idx);
  }
};

#include <flashinfer/attention/variants.cuh>
#include <flashinfer/attention/decode.cuh>

namespace flashinfer {

using Variant = DefaultAttention<false, USE_SLIDING_WINDOW, USE_LOGITS_SOFT_CAP, false>;
// BatchDecodeWithPagedKVCacheDispatched<128, kNone, Variant, Params> with group size 4, sm_80+:
constexpr uint32_t kVecSize = std::max(16UL / sizeof(DTypeKV), HEAD_DIM_QK / 32UL);  // 8
constexpr uint32_t kBdx = HEAD_DIM_QK / kVecSize;                                       // 16
constexpr uint32_t kBdy = 4;                                                            // GROUP_SIZE
constexpr uint32_t kThreads = std::max(128U, kBdx * kBdy);                              // 128
constexpr uint32_t kBdz = kThreads / (kBdx * kBdy);                                     // 2
constexpr uint32_t kTilePerBdx = 1;                     // GROUP_SIZE == 1 ? ... : 1
constexpr uint32_t kStages = 2;                         // DISPATCH_COMPUTE_CAP_DECODE_NUM_STAGES_SMEM, cc >= 8
static_assert(kVecSize == 8 && kBdx == 16 && kBdz == 2);

template __global__ void BatchDecodeWithPagedKVCacheKernel<
    PosEncodingMode::kNone, kStages, kTilePerBdx, kVecSize, kBdx, kBdy, kBdz, Variant, Params>(
    const __grid_constant__ Params params);

}  // namespace flashinfer
