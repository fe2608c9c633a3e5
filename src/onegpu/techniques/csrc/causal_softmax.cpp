// Blocked attention's causal softmax on a CPU, one pass a row (onegpu/techniques/
// causal_softmax_cpu.py): a query block's fp32 scores [N, R, S], row r seeing keys s <= start + r,
// scaled, masked, softmaxed and written in the probabilities' dtype. The row's logits live in a
// buffer that stays in the core's cache; ATen's ops for the same math (an add of the mask, the
// softmax, the cast) each read and write the whole block. The arithmetic is ATen's, step by
// step (the add's product, softmax's max, exponentials, sum and reciprocal, the cast's rounding),
// so the probabilities are the same bits.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <limits>
#include <vector>

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;

inline void store_row(float* out, const float* e, float inv, int64_t S) {
  at::vec::map([inv](fVec x) { return x * fVec(inv); }, out, e, S);
}

inline void store_row(c10::BFloat16* out, const float* e, float inv, int64_t S) {
  constexpr int64_t kStep = 2 * fVec::size();
  const int64_t body = S - S % kStep;
  const fVec inv_v(inv);
  for (int64_t j = 0; j < body; j += kStep) {
    fVec a = fVec::loadu(e + j) * inv_v;
    fVec b = fVec::loadu(e + j + fVec::size()) * inv_v;
    at::vec::convert_from_float<c10::BFloat16>(a, b).store(out + j);
  }
  for (int64_t j = body; j < S; ++j) out[j] = c10::BFloat16(e[j] * inv);
}

template <typename T>
void rows(const float* scores, T* out, int64_t N, int64_t R, int64_t S, int64_t start,
          float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, N * R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(S);
    float* x = buffer.data();
    for (int64_t i = begin; i < end; ++i) {
      const float* s = scores + i * S;
      const int64_t limit = std::min(S, start + i % R + 1);  // keys this query sees
      // the add's mask + scale * s: 0 where the query sees the key, -inf where not (a NaN or
      // +inf score there makes the row NaN, as in ATen)
      for (int64_t j = 0; j < limit; ++j) x[j] = 0.f + s[j] * scale;
      for (int64_t j = limit; j < S; ++j) x[j] = neg_inf + s[j] * scale;
      // ATen's softmax over the last dimension, as _vec_softmax_lastdim computes it
      const float max_x = at::vec::reduce_all<float>(
          [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, x, S);
      at::vec::map([max_x](fVec v) { return (v - fVec(max_x)).exp(); }, x, x, S);
      float sum = at::vec::reduce_all<float>([](fVec a, fVec b) { return a + b; }, x, S);
      store_row(out + i * S, x, 1 / sum, S);
    }
  });
}

}  // namespace

// softmax(scores * scale) with query start + r seeing keys s <= start + r, in bf16 (`to_bf16`)
// or fp32; scores: fp32 [..., R, S] on the CPU
torch::Tensor causal_softmax(torch::Tensor scores, int64_t start, double scale, bool to_bf16) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.dim() >= 2,
              "scores: fp32 [..., R, S] on the CPU");
  auto x = scores.contiguous();
  auto out = torch::empty(x.sizes(), x.options().dtype(to_bf16 ? at::kBFloat16 : at::kFloat));
  if (x.numel() == 0) return out;
  const int64_t R = x.size(-2), S = x.size(-1), N = x.numel() / (R * S);
  const float f = static_cast<float>(scale);
  if (to_bf16) {
    rows(x.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), N, R, S, start, f);
  } else {
    rows(x.data_ptr<float>(), out.data_ptr<float>(), N, R, S, start, f);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_softmax", &causal_softmax, "blocked attention's causal softmax, one pass a row");
}
