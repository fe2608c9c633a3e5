// The chunked loss's per-chunk math on a CPU, row by row (onegpu/techniques/loss_kernel_cpu.py):
// for each row of logits, its max, each exponential once (kept in a row buffer that stays in
// the core's cache), the log-sum-exp and the row's loss, and the gradient softmax - onehot
// written once in the logits' dtype. Columns from n_valid on are vocabulary padding:
// probability 0, gradient 0. Inductor's kernel for the same math computes each exponential
// twice, or keeps them in a [chunk, vocab] fp32 block that goes out to memory and back.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kF = fVec::size();
constexpr int64_t kStep = 2 * kF;  // elements a loop iteration reads: two float vectors

// kStep elements of T as two float vectors, and back
inline std::tuple<fVec, fVec> load(const float* p) {
  return {fVec::loadu(p), fVec::loadu(p + kF)};
}
inline std::tuple<fVec, fVec> load(const c10::BFloat16* p) {
  return at::vec::convert_to_float<c10::BFloat16>(Vectorized<c10::BFloat16>::loadu(p));
}
inline void store(float* p, const fVec& a, const fVec& b) {
  a.store(p);
  b.store(p + kF);
}
inline void store(c10::BFloat16* p, const fVec& a, const fVec& b) {
  at::vec::convert_from_float<c10::BFloat16>(a, b).store(p);
}

template <typename T>
void rows(const T* x, T* g, const int64_t* targets, const bool* valid, float* losses,
          int64_t c, int64_t V, int64_t n) {
  at::parallel_for(0, c, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(n);
    float* e = buffer.data();
    for (int64_t i = begin; i < end; ++i) {
      const T* xi = x + i * V;
      T* gi = g + i * V;
      const int64_t body = n - n % kStep;
      fVec max_v(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < body; j += kStep) {
        auto [a, b] = load(xi + j);
        max_v = at::vec::maximum(max_v, at::vec::maximum(a, b));
      }
      float m = at::vec::vec_reduce_all<float>(
          [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, max_v);
      for (int64_t j = body; j < n; ++j) m = std::max(m, static_cast<float>(xi[j]));
      const fVec m_v(m);
      fVec sum_v(0.f);
      for (int64_t j = 0; j < body; j += kStep) {
        auto [a, b] = load(xi + j);
        a = (a - m_v).exp();
        b = (b - m_v).exp();
        store(e + j, a, b);
        sum_v = sum_v + a + b;
      }
      float s = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, sum_v);
      for (int64_t j = body; j < n; ++j) {
        e[j] = std::exp(static_cast<float>(xi[j]) - m);
        s += e[j];
      }
      const fVec s_v(s);
      for (int64_t j = 0; j < body; j += kStep) {
        store(gi + j, fVec::loadu(e + j) / s_v, fVec::loadu(e + j + kF) / s_v);
      }
      for (int64_t j = body; j < n; ++j) gi[j] = static_cast<T>(e[j] / s);
      for (int64_t j = n; j < V; ++j) gi[j] = static_cast<T>(0.f);
      const float w = valid[i] ? 1.f : 0.f;
      const int64_t t = targets[i];
      gi[t] = static_cast<T>(e[t] / s - w);
      losses[i] = (m + std::log(s) - static_cast<float>(xi[t])) * w;
    }
  });
}

}  // namespace

// (summed loss, d loss / d logits) of a chunk: logits [c, V] (bf16 or fp32, contiguous),
// targets [c] int64 (valid columns), valid [c] bool (False: an ignored token, adding nothing)
std::tuple<torch::Tensor, torch::Tensor> softmax_grad(
    torch::Tensor logits, torch::Tensor targets, torch::Tensor valid, int64_t n_valid) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cpu(),
              "logits: a contiguous [chunk, vocab] CPU tensor");
  TORCH_CHECK(targets.scalar_type() == at::kLong && valid.scalar_type() == at::kBool,
              "targets int64, valid bool");
  TORCH_CHECK(0 < n_valid && n_valid <= logits.size(1), "n_valid within the vocabulary");
  auto t = targets.contiguous();
  auto ok = valid.contiguous();
  const int64_t c = logits.size(0), V = logits.size(1);
  auto grad = torch::empty_like(logits);
  auto losses = torch::empty({c}, logits.options().dtype(at::kFloat));
  if (logits.scalar_type() == at::kBFloat16) {
    rows(logits.data_ptr<c10::BFloat16>(), grad.data_ptr<c10::BFloat16>(), t.data_ptr<int64_t>(),
         ok.data_ptr<bool>(), losses.data_ptr<float>(), c, V, n_valid);
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kFloat, "logits: bf16 or fp32");
    rows(logits.data_ptr<float>(), grad.data_ptr<float>(), t.data_ptr<int64_t>(),
         ok.data_ptr<bool>(), losses.data_ptr<float>(), c, V, n_valid);
  }
  return {losses.sum(), grad};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("softmax_grad", &softmax_grad, "the chunked loss's per-chunk math, row by row");
}
