// The torch-level operations of the extension that other units call directly (not through Python):
// the dense product (moe_cpu.cpp) and the decode step's small operations (step_ops.cpp), as their
// Python bindings describe them. decode_layer.cpp chains them into one call per layer.
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

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, double eps);
at::Tensor qk_norm_rope(const at::Tensor& heads, const std::optional<at::Tensor>& weight, const at::Tensor& cos,
                        const at::Tensor& sin_signed, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_topk(const at::Tensor& logits, int64_t top_k, bool normalize);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& tables,
                            const at::Tensor& mask, const std::string& variant);

}  // namespace moemesh_cpu
