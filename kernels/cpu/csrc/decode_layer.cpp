// A decoder layer's attention half of a decode step in one call: the residual add and input norm, the
// q/k/v projection (and its bias), the per-head q/k norm with rope, decode attention over the paged KV
// cache, the output projection, the residual add and post-attention norm, and for a MoE layer the
// router's logits and the top-k dispatch plan; and, with the layers' experts held in process
// (`LayerExperts` below), the routed expert MLP on that plan, for a run of consecutive MoE layers:
// their whole decode step in one call.
//
// Each stage is the extension's own operation (ops.h) that the Python decoder
// (moemesh/models/decoder.py, attention.py, layers.py, moe/dispatch.py) calls one by one on a decode
// step, in the same order with the same rounding points, so the results are the same values; what goes
// is the Python and torch dispatch between them (6-8% of a sparse model's batch-1 decode
// step on 2 cores: docs/benchmarks.md).
//
// Shape legend: T decoding tokens (one per sequence), H hidden, NH query heads, KVH key/value heads,
// D head dim, E experts, N = T*K routed rows, G experts that receive rows.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ops.h"

namespace moemesh_cpu {
namespace {

// One matrix W [N, K] as `linear` reads it: format ints, data, scale, scale2 (moe_cpu.cpp weights_of).
struct Projection {
  std::vector<int64_t> ints;
  at::Tensor data, scale, scale2;

  // x [T, K] -> x @ W.T [T, N] in x's dtype (rounded once, as the Python `layers.linear` rounds it)
  at::Tensor apply(const at::Tensor& x, const std::string& variant) const {
    return linear_as(x, ints, data, scale, scale2, variant, x.scalar_type());
  }
};

using ProjectionArgs = std::tuple<std::vector<int64_t>, at::Tensor, at::Tensor, at::Tensor>;

// data held as [1, N, ...] (the one-matrix form `linear` reads), so that no call has to make that view
Projection projection_of(const ProjectionArgs& a) {
  const at::Tensor& data = std::get<1>(a);
  return {std::get<0>(a), data.dim() == 2 ? data.unsqueeze(0) : data, std::get<2>(a), std::get<3>(a)};
}

// rows [T] of `count` heads of D elements from head `first` of a contiguous [T, R, D] buffer base
// (alive while the view is used), as a [T, count, D] tensor: the narrowing a decode step does per
// layer, without a dispatch (a few µs each where the step's caches run cold)
at::Tensor heads_of(const at::Tensor& base, int64_t first, int64_t count) {
  const int64_t t = base.size(0), r = base.size(1), d = base.size(2);
  char* p = static_cast<char*>(base.data_ptr()) + first * d * base.element_size();
  return at::from_blob(p, {t, count, d}, {r * d, d, 1}, base.options());
}

// The weights of one layer, handed over once at load (the tensors are shared, not copied).
struct DecodeLayer {
  at::Tensor input_norm, post_norm;  // [H]
  Projection qkv, o;                 // [(NH + 2 KVH) D, H], [H, NH D]
  std::optional<Projection> router;  // [E, H] for a MoE layer
  std::optional<at::Tensor> qkv_bias;  // [(NH + 2 KVH) D]
  std::optional<at::Tensor> qk_norm;   // [NH + KVH, D]: the q norm's rows, then the k norm's
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, qk_eps;
};

DecodeLayer make_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, const ProjectionArgs& qkv,
                       const ProjectionArgs& o, const std::optional<ProjectionArgs>& router,
                       const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& qk_norm,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double qk_eps) {
  TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && num_heads % num_kv_heads == 0,
                    "heads: expected num_kv_heads dividing num_heads and a positive head_dim, got ", num_heads, ", ",
                    num_kv_heads, ", ", head_dim);
  std::optional<Projection> r;
  if (router) r = projection_of(*router);
  return {input_norm, post_norm, projection_of(qkv), projection_of(o), r, qkv_bias, qk_norm,
          num_heads,  num_kv_heads, head_dim, eps, qk_eps};
}

using Step = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// x [T, H] the residual stream, residual [T, H] the previous layer's MLP output (None for the first
// layer); cos / sin_signed [T, 1, D] (`rope_for_step`); the KV cache, slots, tables and mask as
// decode_attention takes them. top_k 0: no routing (a dense layer, or a plan the caller makes) ->
// (x + residual, h = post_norm(x + residual + attention), token_idx [N], weights [N], expert_ids [G],
// counts [G]); the last four are None without routing.
Step run(const DecodeLayer& L, const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& cos,
         const at::Tensor& sin_signed, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
         const at::Tensor& tables, const at::Tensor& mask, int64_t top_k, bool normalize, const std::string& variant) {
  const int64_t hidden = L.input_norm.size(0);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == hidden, "x: expected [T, ", hidden, "], got ", x.sizes());
  TORCH_CHECK_VALUE(!residual || residual->sizes() == x.sizes(), "residual: expected the shape of x ", x.sizes(), ", got ",
                    residual->sizes());
  TORCH_CHECK_VALUE(top_k == 0 || L.router, "top_k: this layer has no router");
  const int64_t t = x.size(0), nh = L.num_heads, kvh = L.num_kv_heads, d = L.head_dim;
  at::Tensor x1, h0;
  if (residual) {
    std::tie(x1, h0) = add_rms_norm(x, *residual, L.input_norm, L.eps);
  } else {
    x1 = x;
    h0 = rms_norm(x, L.input_norm, L.eps);
  }
  at::Tensor qkv = L.qkv.apply(h0, variant);  // [T, (NH + 2 KVH) D]
  if (L.qkv_bias) qkv = qkv + *L.qkv_bias;
  TORCH_CHECK_VALUE(qkv.size(1) == (nh + 2 * kvh) * d, "qkv: expected ", (nh + 2 * kvh) * d, " columns, got ", qkv.size(1));
  TORCH_CHECK(qkv.is_contiguous(), "qkv: expected a contiguous projection");
  const at::Tensor heads = at::from_blob(qkv.data_ptr(), {t, nh + 2 * kvh, d}, qkv.options());  // a view of qkv
  const at::Tensor qk = qk_norm_rope(heads_of(heads, 0, nh + kvh), L.qk_norm, cos, sin_signed, L.qk_eps);  // [T, NH + KVH, D]
  const at::Tensor attn = decode_attention(heads_of(qk, 0, nh), heads_of(qk, nh, kvh), heads_of(heads, nh + kvh, kvh),
                                           k_cache, v_cache, slots, tables, mask, variant);  // [T, NH, D]
  at::Tensor x2, h;
  const at::Tensor attn_rows = at::from_blob(attn.data_ptr(), {t, nh * d}, attn.options());  // [T, NH D], a view of attn
  std::tie(x2, h) = add_rms_norm(x1, L.o.apply(attn_rows, variant), L.post_norm, L.eps);
  if (top_k == 0) return {x2, h, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  at::Tensor token_idx, weights, expert_ids, counts;
  std::tie(token_idx, weights, expert_ids, counts) = route_topk(L.router->apply(h, variant), top_k, normalize);
  return {x2, h, token_idx, weights, expert_ids, counts};
}

// One MoE layer's experts as moe_mlp reads them (every expert of the layer, local index == expert id),
// handed over once; the tensors are shared, not copied.
struct LayerExperts {
  std::vector<int64_t> gu_ints;
  at::Tensor gu_data, gu_scale, gu_scale2;
  std::optional<at::Tensor> gu_bias;
  std::vector<int64_t> dn_ints;
  at::Tensor dn_data, dn_scale, dn_scale2;
  std::optional<at::Tensor> dn_bias;
  int64_t act, inter;
};

LayerExperts make_experts(const ProjectionArgs& gu, const std::optional<at::Tensor>& gu_bias, const ProjectionArgs& dn,
                          const std::optional<at::Tensor>& dn_bias, int64_t act, int64_t inter) {
  TORCH_CHECK_VALUE(inter > 0, "inter: expected a positive intermediate size, got ", inter);
  return {std::get<0>(gu), std::get<1>(gu), std::get<2>(gu), std::get<3>(gu), gu_bias,
          std::get<0>(dn), std::get<1>(dn), std::get<2>(dn), std::get<3>(dn), dn_bias, act, inter};
}

// `run` with routing (top_k > 0), then the experts on its plan -> (x + residual, the layer's MLP
// output [T, H] in x's dtype: what the next layer takes as its residual).
std::tuple<at::Tensor, at::Tensor> run_with_experts(
    const DecodeLayer& L, const LayerExperts& X, const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const at::Tensor& cos, const at::Tensor& sin_signed, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& mask, int64_t top_k, bool normalize,
    const std::string& variant) {
  TORCH_CHECK_VALUE(top_k > 0, "top_k: the experts need a routed layer, got ", top_k);
  at::Tensor x2, h, token_idx, weights, expert_ids, counts;
  std::tie(x2, h, token_idx, weights, expert_ids, counts) =
      run(L, x, residual, cos, sin_signed, k_cache, v_cache, slots, tables, mask, top_k, normalize, variant);
  at::Tensor out = moe_mlp(h, token_idx, weights, expert_ids, counts, X.gu_ints, X.gu_data, X.gu_scale, X.gu_scale2,
                           X.gu_bias, X.dn_ints, X.dn_data, X.dn_scale, X.dn_scale2, X.dn_bias, X.act, X.inter, variant);
  return {x2, out};
}

// run_with_experts over consecutive MoE layers, each layer's MLP output the next one's residual ->
// (x + the last residual added, the last layer's MLP output). Per layer: its weights, experts, KV
// cache and top-k.
std::tuple<at::Tensor, at::Tensor> run_layers_with_experts(
    const std::vector<const DecodeLayer*>& layers, const std::vector<const LayerExperts*>& experts, const at::Tensor& x,
    const std::optional<at::Tensor>& residual, const at::Tensor& cos, const at::Tensor& sin_signed,
    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches, const at::Tensor& slots,
    const at::Tensor& tables, const at::Tensor& mask, const std::vector<int64_t>& top_ks, bool normalize,
    const std::string& variant) {
  const size_t n = layers.size();
  TORCH_CHECK_VALUE(n > 0 && experts.size() == n && k_caches.size() == n && v_caches.size() == n && top_ks.size() == n,
                    "layers: expected as many experts, k caches, v caches and top-k values as layers (", n, "), got ",
                    experts.size(), ", ", k_caches.size(), ", ", v_caches.size(), ", ", top_ks.size());
  at::Tensor cur = x;  // [T, H] the residual stream
  std::optional<at::Tensor> res = residual;
  for (size_t i = 0; i < n; ++i) {
    at::Tensor out;
    std::tie(cur, out) = run_with_experts(*layers[i], *experts[i], cur, res, cos, sin_signed, k_caches[i], v_caches[i],
                                          slots, tables, mask, top_ks[i], normalize, variant);
    res = out;
  }
  return {cur, *res};
}

}  // namespace

// the GIL is released while a layer runs, as for the other kernels
void bind_decode_layer(pybind11::module_& m) {
  pybind11::class_<DecodeLayer>(m, "DecodeLayer", "one decoder layer's attention-half weights, for decode_layer")
      .def(pybind11::init(&make_layer));
  m.def("decode_layer", &run,
        "x [T, H], the previous MLP output or None -> (x + it, the post-attention norm of x + it + attention, and with "
        "top_k > 0 the dispatch plan token_idx, weights, expert_ids, counts)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<LayerExperts>(m, "LayerExperts", "one MoE layer's experts, for decode_layers_experts")
      .def(pybind11::init(&make_experts));
  m.def("decode_layers_experts", &run_layers_with_experts,
        "consecutive MoE layers, each decode_layer with routing then its experts on the plan, each layer's MLP output "
        "the next one's residual -> (x + the last residual added, the last layer's MLP output)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace moemesh_cpu
