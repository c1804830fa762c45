/* ops_cuda.cu — the CUDA backend's kernel table (kernels/ops.h). Each entry lives in the file
 * of its layer; every one takes a device made by dt_device_cuda_create and issues its work on
 * that device's stream.
 *
 * The table is built by a constexpr function that names every field (C++17 has no designated
 * initializers): it is a compile-time constant, a field of dt_ops_t not assigned here stays
 * NULL rather than receiving a neighbour's entry, and the order of the fields does not matter. */
#include "cuda_impl.h"
#include "flash.cuh" /* FLASH_MAX_HS */

static constexpr dt_ops_t make_cuda_ops(void)
{
  dt_ops_t o{};
  o.name = "cuda";
  o.encoder_forward = dt__cuda_encoder_forward;
  o.encoder_backward = dt__cuda_encoder_backward;
  o.layernorm_forward = dt__cuda_layernorm_forward;
  o.residual_layernorm_forward = dt__cuda_residual_layernorm_forward;
  o.layernorm_forward_bf16 = dt__cuda_layernorm_forward_bf16;
  o.residual_layernorm_forward_bf16 = dt__cuda_residual_layernorm_forward_bf16;
  o.layernorm_backward = dt__cuda_layernorm_backward;
  o.layernorm_backward_bf16 = dt__cuda_layernorm_backward_bf16;
  o.matmul_forward = dt__cuda_matmul_forward;
  o.matmul_backward = dt__cuda_matmul_backward;
  o.matmul_forward_bf16 = dt__cuda_matmul_forward_bf16;
  o.matmul_backward_bf16 = dt__cuda_matmul_backward_bf16;
  o.bf16_bytes = 2; /* __nv_bfloat16 */
  o.to_bf16 = dt__cuda_to_bf16;
  o.padded_head = 1;
  o.attention_forward = dt__cuda_attention_forward;
  o.attention_backward = dt__cuda_attention_backward;
  o.attention_forward_cp = dt__cuda_attention_forward_cp;
  o.attention_backward_cp = dt__cuda_attention_backward_cp;
  o.attention_forward_flash = dt__cuda_attention_forward_flash;
  o.attention_backward_flash = dt__cuda_attention_backward_flash;
  o.flash_max_head_size = FLASH_MAX_HS;
  o.attention_forward_flash_bf16 = dt__cuda_attention_forward_flash_bf16;
  o.attention_backward_flash_bf16 = dt__cuda_attention_backward_flash_bf16;
  o.gelu_forward = dt__cuda_gelu_forward;
  o.gelu_backward = dt__cuda_gelu_backward;
  o.residual_forward = dt__cuda_residual_forward;
  o.crossentropy_forward_backward = dt__cuda_crossentropy_forward_backward;
  o.crossentropy_forward_backward_bf16 = dt__cuda_crossentropy_forward_backward_bf16;
  o.crossentropy_vp_stats = dt__cuda_crossentropy_vp_stats;
  o.crossentropy_vp_stats_bf16 = dt__cuda_crossentropy_vp_stats_bf16;
  o.crossentropy_vp_finish = dt__cuda_crossentropy_vp_finish;
  o.crossentropy_vp_finish_bf16 = dt__cuda_crossentropy_vp_finish_bf16;
  o.adamw_update = dt__cuda_adamw_update;
  o.sum_squares = dt__cuda_sum_squares;
  return o;
}

static constexpr dt_ops_t g_cuda_ops = make_cuda_ops();

extern "C" const dt_ops_t *dt_ops_cuda(void)
{
  return &g_cuda_ops;
}
