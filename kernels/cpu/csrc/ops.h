// The torch-level operations of the extension that other units call directly (not through Python):
// the dense product and the routed expert MLP (moe_cpu.cpp) and the decode step's small operations
// (step_ops.cpp), as their Python bindings describe them. decode_layer.cpp chains them into one call
// per layer, and per run of MoE layers with their experts.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace moemesh_cpu {

// x [M, K] @ W.T -> [M, N] float32 for one matrix W in any stored format (ints, data, scale, scale2).
at::Tensor linear(const at::Tensor& x, const std::vector<int64_t>& ints, const at::Tensor& data, const at::Tensor& scale,
                  const at::Tensor& scale2, const std::string& variant);
// the same product rounded to out_dtype (float32 or bfloat16) as it is written, with no second tensor
at::Tensor linear_as(const at::Tensor& x, const std::vector<int64_t>& ints, const at::Tensor& data,
                     const at::Tensor& scale, const at::Tensor& scale2, const std::string& variant,
                     at::ScalarType out_dtype);

// The routed expert MLP (gather, gate_up with the activation, down, weighted float32 combine) over the
// experts' weights as stored: x [T, H], token_idx [N], row_weight [N], expert_idx [G], counts [G] ->
// [T, H] in x's dtype.
at::Tensor moe_mlp(const at::Tensor& x, const at::Tensor& token_idx, const at::Tensor& row_weight,
                   const at::Tensor& expert_idx, const at::Tensor& counts,
                   const std::vector<int64_t>& gu_ints, const at::Tensor& gu_data, const at::Tensor& gu_scale,
                   const at::Tensor& gu_scale2, const c10::optional<at::Tensor>& gu_bias,
                   const std::vector<int64_t>& dn_ints, const at::Tensor& dn_data, const at::Tensor& dn_scale,
                   const at::Tensor& dn_scale2, const c10::optional<at::Tensor>& dn_bias,
                   int64_t act, int64_t inter, const std::string& variant);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, double eps);
at::Tensor qk_norm_rope(const at::Tensor& heads, const std::optional<at::Tensor>& weight, const at::Tensor& cos,
                        const at::Tensor& sin_signed, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_topk(const at::Tensor& logits, int64_t top_k, bool normalize);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& tables,
                            const at::Tensor& mask, const std::string& variant);

}  // namespace moemesh_cpu
