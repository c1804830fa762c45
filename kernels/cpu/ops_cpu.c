/* ops_cpu.c — the CPU backend's kernel table. */
#include "../ops.h"
#include "cpu_kernels.h"

static const dt_ops_t g_cpu_ops = {
    .name = "cpu",
    .encoder_forward = dt_cpu_encoder_forward,
    .encoder_backward = dt_cpu_encoder_backward,
    .layernorm_forward = dt_cpu_layernorm_forward,
    .layernorm_backward = dt_cpu_layernorm_backward,
    .matmul_forward = dt_cpu_matmul_forward,
    .matmul_backward = dt_cpu_matmul_backward,
    .attention_forward = dt_cpu_attention_forward,
    .attention_backward = dt_cpu_attention_backward,
    .gelu_forward = dt_cpu_gelu_forward,
    .gelu_backward = dt_cpu_gelu_backward,
    .residual_forward = dt_cpu_residual_forward,
    .crossentropy_forward_backward = dt_cpu_crossentropy_forward_backward,
    .crossentropy_vp_stats = dt_cpu_crossentropy_vp_stats,
    .crossentropy_vp_finish = dt_cpu_crossentropy_vp_finish,
    .adamw_update = dt_cpu_adamw_update,
    .sum_squares = dt_cpu_sum_squares,
};

const dt_ops_t *dt_ops_cpu(void)
{
  return &g_cpu_ops;
}
