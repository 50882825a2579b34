// A few rows times a weight matrix at memory speed on a CPU: y = x · W for x [R, K] with R small (a decode
// step scores 1 to ~16 positions), W [K, N] ("nn") or W [N, K] ("nt", the output table [V, E]).
//
// Why it exists (experiments/smollm2_eagle): XLA:CPU runs one row as a matrix-vector loop near memory speed but
// two or more as a GEMM at about half of it, so scoring γ + 1 positions cost 1.4–1.7× one. Here every weight is
// read from memory once for all R rows, and each row's sums are formed in the same order whatever R is: row r
// of a call with R rows equals the same row computed alone, bit for bit.
//
// The loops keep R × (a few 16-float vectors) of accumulators in registers and prefetch the next block of W
// linearly while the current one is read in strips (without it the strided walk ran at half the bandwidth).
// Portable C++ with GCC/Clang vector extensions; built with -march=native by specdec/models/cpu_kernel.py.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__) || !defined(__AVX__)
typedef float v16 __attribute__((vector_size(64), aligned(4)));

inline v16 load(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline void store(float* p, v16 v) { *reinterpret_cast<v16*>(p) = v; }
inline float lane(v16 v, int i) { return v[i]; }
constexpr int kVectorRegisters = 32;  // v16 values the register file holds (AVX-512: 32 zmm)
#else
// AVX without AVX-512: 16 floats as two 8-float registers. GCC lowers a 64-byte generic vector on a 32-byte target
// through memory (measured on an AVX2 AMD EPYC: a fifth of XLA's matrix-vector speed); two native halves do not.
typedef float v8 __attribute__((vector_size(32), aligned(4)));
struct v16 {
  v8 lo, hi;
};
inline v16 operator*(float a, v16 b) { return {a * b.lo, a * b.hi}; }
inline v16 operator*(v16 a, float b) { return {a.lo * b, a.hi * b}; }
inline v16 operator*(v16 a, v16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline v16& operator+=(v16& a, v16 b) {
  a.lo += b.lo;
  a.hi += b.hi;
  return a;
}
inline v16 load(const float* p) { return {*reinterpret_cast<const v8*>(p), *reinterpret_cast<const v8*>(p + 8)}; }
inline void store(float* p, v16 v) {
  *reinterpret_cast<v8*>(p) = v.lo;
  *reinterpret_cast<v8*>(p + 8) = v.hi;
}
inline float lane(v16 v, int i) { return i < 8 ? v.lo[i] : v.hi[i - 8]; }
constexpr int kVectorRegisters = 8;   // 16 ymm registers hold 8 v16
#endif

// A fixed pairwise order, so that results do not depend on the compiler's choices.
inline float hsum(v16 v) {
  float s[8];
  for (int i = 0; i < 8; ++i) s[i] = lane(v, i) + lane(v, i + 8);
  for (int i = 0; i < 4; ++i) s[i] += s[i + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// Register tiles of the [K, N] loop: R rows × T vectors of accumulators beside T of W and a broadcast x; with 16
// ymm registers (AVX2) fewer rows and, past two rows, one vector (measured on an AMD EPYC znver2: 8–10 % faster
// at 3–5 rows than tiles sized for AVX-512's 32, which spill). The [N, K] loop's J × R tile spills there too, yet
// smaller tiles measured no faster. Tiles only regroup the work: each row's sums are formed in the same order.
constexpr int64_t kMaxRowsNN = kVectorRegisters >= 32 ? 8 : 6;   // rows per register tile of the [K, N] loop
constexpr int64_t kMaxRowsNT = 5;   // rows per register tile of the [N, K] loop
constexpr int64_t kRowsPerBlock = 8;  // k rows of W per block of the [K, N] loop (a 4 KiB stride aliases beyond)
constexpr int kColumnVectors = 2;   // 16-float vectors of columns per strip of the [K, N] loop (fewer for many rows)
constexpr int kTableRows = 5;       // rows of W per block of the [N, K] loop

// Vectors of columns per strip for a tile of R rows: two where their accumulators fit beside W and x.
template <int R>
constexpr int strip_vectors() { return R * kColumnVectors + kColumnVectors < kVectorRegisters ? kColumnVectors : 1; }
constexpr int64_t kSpinMicroseconds = 100;  // measured on SmolLM2's step: 20 µs and sleeping at once were slower and less even
constexpr int64_t kMinPartWeights = 1 << 16;  // smaller parts cost more to hand over than they save

// y[r, c0 : c0 + 16·T] (+)= Σ_{k0 ≤ k < k1} x[r, k] · w[k, c0 : …], advancing the prefetch pointer pf.
template <int R, int T>
void nn_strip(const float* x, int64_t K, const float* w, int64_t N, float* y, int64_t c0, int64_t k0,
              int64_t k1, const float*& pf) {
  v16 acc[R][T];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[r][t] = k0 == 0 ? v16{} : load(y + r * N + c0 + 16 * t);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * N + c0;
    v16 wv[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) wv[t] = load(wk + 16 * t);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) __builtin_prefetch(pf + 16 * t);
    pf += 16 * T;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * K + k];
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) acc[r][t] += xr * wv[t];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) store(y + r * N + c0 + 16 * t, acc[r][t]);
}

// Rows [0, R) of y (+)= x[:, k0:k1] · w[k0:k1, :] for R ≤ kMaxRowsNN.
template <int R>
void nn_block(const float* x, int64_t K, const float* w, int64_t N, float* y, int64_t k0, int64_t k1,
              int64_t c_lo, int64_t c_hi, const float* pf) {
  constexpr int T = strip_vectors<R>();
  int64_t c = c_lo;
  for (; c + 16 * T <= c_hi; c += 16 * T) nn_strip<R, T>(x, K, w, N, y, c, k0, k1, pf);
  for (; c + 16 <= c_hi; c += 16) nn_strip<R, 1>(x, K, w, N, y, c, k0, k1, pf);
  for (; c < c_hi; ++c)
    for (int r = 0; r < R; ++r) {
      float s = k0 == 0 ? 0.f : y[r * N + c];
      for (int64_t k = k0; k < k1; ++k) s += x[r * K + k] * w[k * N + c];
      y[r * N + c] = s;
    }
}

// Columns [c_lo, c_hi) of y [R, N] = x [R, K] · w [K, N]: W is read in blocks of kRowsPerBlock rows, each
// once for all rows. The part of a call whose columns start at c_lo prefetches the same share of the next block.
void matmul_nn(const float* x, int64_t R, int64_t K, const float* w, int64_t N, float* y, int64_t c_lo,
               int64_t c_hi) {
  for (int64_t k0 = 0; k0 < K; k0 += kRowsPerBlock) {
    const int64_t k1 = std::min(K, k0 + kRowsPerBlock);
    for (int64_t r0 = 0; r0 < R; r0 += kMaxRowsNN) {
      // The next block, fetched linearly while this one is read in strips (by the first tile of rows only).
      const float* pf = (r0 == 0 ? w + k1 * N : w + k0 * N) + (k1 - k0) * c_lo;
      const float* xr = x + r0 * K;
      float* yr = y + r0 * N;
      switch (std::min(kMaxRowsNN, R - r0)) {
#define SPECDEC_NN(n) case n: nn_block<n>(xr, K, w, N, yr, k0, k1, c_lo, c_hi, pf); break;
        SPECDEC_NN(1) SPECDEC_NN(2) SPECDEC_NN(3) SPECDEC_NN(4)
        SPECDEC_NN(5) SPECDEC_NN(6) SPECDEC_NN(7) SPECDEC_NN(8)
#undef SPECDEC_NN
      }
    }
  }
}

// y[r, n0 + j] = x[r, :] · w[n0 + j, :] for r < R ≤ kMaxRowsNT, j < J (16-float lanes, then a fixed hsum).
template <int R, int J>
void nt_block(const float* x, int64_t K, const float* w, int64_t N, float* y, int64_t n0, bool prefetch) {
  v16 acc[J][R] = {};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    v16 xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = load(x + r * K + k);
    if (prefetch) {
      const float* pf = w + (n0 + J) * K + J * k;  // the next block of J rows, linearly
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) __builtin_prefetch(pf + 16 * j);
    }
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) {
      const v16 wv = load(w + (n0 + j) * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[j][r] += wv * xv[r];
    }
  }
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[j][r]);
      for (int64_t kk = k; kk < K; ++kk) s += x[r * K + kk] * w[(n0 + j) * K + kk];
      y[r * N + n0 + j] = s;
    }
}

template <int J>
void nt_rows(const float* x, int64_t R, int64_t K, const float* w, int64_t N, float* y, int64_t n0, int64_t n_hi) {
  for (int64_t r0 = 0; r0 < R; r0 += kMaxRowsNT) {
    const bool prefetch = r0 == 0 && n0 + 2 * J <= n_hi;
    const float* xr = x + r0 * K;
    float* yr = y + r0 * N;
    switch (std::min(kMaxRowsNT, R - r0)) {
#define SPECDEC_NT(n) case n: nt_block<n, J>(xr, K, w, N, yr, n0, prefetch); break;
      SPECDEC_NT(1) SPECDEC_NT(2) SPECDEC_NT(3) SPECDEC_NT(4) SPECDEC_NT(5)
#undef SPECDEC_NT
    }
  }
}

// Columns [n_lo, n_hi) of y [R, N] = x [R, K] · w [N, K]ᵀ: W is read in blocks of kTableRows rows, each once
// for all rows.
void matmul_nt(const float* x, int64_t R, int64_t K, const float* w, int64_t N, float* y, int64_t n_lo,
               int64_t n_hi) {
  int64_t n = n_lo;
  for (; n + kTableRows <= n_hi; n += kTableRows) nt_rows<kTableRows>(x, R, K, w, N, y, n, n_hi);
  for (; n < n_hi; ++n) nt_rows<1>(x, R, K, w, N, y, n, n_hi);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Runs part(0), …, part(parts − 1) on the caller and XLA's intra-op threads. A part is claimed before it runs,
// and the caller waits only for parts that others claimed (and so are running): if every pool thread is busy,
// the caller runs them all, and a task that starts after the call returned finds nothing left to claim.
template <typename Part>
void parallel_parts(ffi::ThreadPool& pool, int64_t parts, const Part& part) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mutex;
    std::condition_variable finished;
  };
  auto state = std::make_shared<State>();
  auto work = [state, parts, part_ptr = &part] {
    for (int64_t p; (p = state->next.fetch_add(1)) < parts;) {
      (*part_ptr)(p);
      if (state->done.fetch_add(1) + 1 == parts) {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->finished.notify_all();
      }
    }
  };
  for (int64_t i = 1; i < parts; ++i) pool.Schedule(decltype(work)(work));
  work();
  // The other parts are running (claimed): spin a few microseconds (a sleeping caller's wake-up cost ~3 ms a
  // SmolLM2 step), then sleep (a spinning caller that shares a core with the thread it waits for halves both).
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicroseconds);
  for (int i = 1; state->done.load(std::memory_order_acquire) < parts; ++i) {
    cpu_relax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() > spin_until) break;
  }
  std::unique_lock<std::mutex> lock(state->mutex);
  state->finished.wait(lock, [&] { return state->done.load() == parts; });
}

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y, bool transposed) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const int64_t w_rank = w_dims.size();
  if (x_dims.size() < 1 || w_rank < 2) return ffi::Error::InvalidArgument("rows_matmul: x needs a last axis, w two");
  int64_t w_batch = 1;  // leading axes of w that vmap(expand_dims) adds: all of size 1, or w is not shared
  for (int64_t i = 0; i + 2 < w_rank; ++i) w_batch *= w_dims[i];
  if (w_batch != 1) return ffi::Error::InvalidArgument("rows_matmul: w is batched; only x may be");
  const int64_t K = x_dims[x_dims.size() - 1];
  const int64_t N = transposed ? w_dims[w_rank - 2] : w_dims[w_rank - 1];
  if (K != (transposed ? w_dims[w_rank - 1] : w_dims[w_rank - 2]))
    return ffi::Error::InvalidArgument("rows_matmul: x's last axis and w's contracted axis differ");
  if (K == 0) {  // an empty sum
    std::fill_n(y->typed_data(), y->element_count(), 0.f);
    return ffi::Error::Success();
  }
  const int64_t R = x.element_count() / K;
  // Column ranges of whole strips / blocks, one per thread (more, narrower parts measured slower); a matrix too
  // small to share stays on the caller.
  const int64_t unit = transposed ? kTableRows : 16 * kColumnVectors;
  const int64_t units = (N + unit - 1) / unit;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::clamp<int64_t>(std::min(threads, K * N / kMinPartWeights), 1, units);
  const float* xd = x.typed_data();
  const float* wd = w.typed_data();
  float* yd = y->typed_data();
  parallel_parts(pool, parts, [&](int64_t p) {
    const int64_t lo = std::min(N, units * p / parts * unit), hi = std::min(N, units * (p + 1) / parts * unit);
    if (transposed) matmul_nt(xd, R, K, wd, N, yd, lo, hi);
    else matmul_nn(xd, R, K, wd, N, yd, lo, hi);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(specdec_rows_matmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed"));
