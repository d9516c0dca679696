// specjax's few-row kernels for XLA:CPU (see row_kernel.py for why and where they run).
//
// Products, y[R, 16 P] = x[R, d] @ W, the weight packed as panels Wp[P][d][16] (column block
// p of W, row by row). Each panel is streamed once, front to back; the R rows' accumulators
// (two 8-wide vectors per row, up to 6 rows per pass) stay in registers over the whole
// contraction, so the weight is read from memory once whatever R is, and R adds only
// arithmetic. A large weight's panels are split into parts shared out over XLA's intra-op
// thread pool; the calling thread claims parts too and only waits for parts another thread
// has begun, so a busy pool never blocks it. Each panel is computed whole by one thread.
//
// Cache attention of few query rows: scores by the same passes over the keys (stored [D, S],
// 16 slots a block, prefetched ahead), exponentials 8 lanes at a time, values mixed with the
// head's accumulators in registers; only slots up to the last visible one are read. Parts
// are blocks of query rows.
//
// Exactness: a row's numbers run in the same order whatever R is and whichever pass or part
// holds it, so a row's result is bit-identical between a one-row call and a many-row call
// (plain decoding and verification compute the same numbers).
//
// Portable C++ (GCC/Clang vector extensions, no intrinsics): built on the user's machine
// with -O3 -march=native, it takes that machine's vector width.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <functional>
#include <limits>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));
constexpr int kPanel = 16;
constexpr int kMaxRows = 6;  // rows per pass: 2 x 6 accumulators + 2 weight vectors

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }

// Keeps a and b in vector registers from here on: without it GCC folds the weight's loads
// into every row's FMA (R = 2-4), and the passes run load-bound at half the FMA rate
// (x86 with AVX: an empty asm; elsewhere nothing, the compiler's choice).
inline void InRegisters(v8& a, v8& b) {
#if defined(__AVX__) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+x"(a), "+x"(b));
#else
  (void)a;
  (void)b;
#endif
}

// One pass: rows x[R][d] times the 16 columns at wp (column k's 16 values at wp + stride k).
template <int R>
inline void Pass(int64_t d, int64_t ny, const float* x, const float* wp, float* y,
                 int64_t stride, int64_t ahead) {
  v8 a0[R], a1[R];
  for (int r = 0; r < R; ++r) {
    a0[r] = v8{};
    a1[r] = v8{};
  }
  for (int64_t k = 0; k < d; ++k) {
    if (ahead != 0) __builtin_prefetch(wp + stride * k + ahead);
    v8 w0 = load8(wp + stride * k), w1 = load8(wp + stride * k + 8);
    InRegisters(w0, w1);
    for (int r = 0; r < R; ++r) {
      const float s = x[r * d + k];
      a0[r] += s * w0;
      a1[r] += s * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    store8(y + r * ny, a0[r]);
    store8(y + r * ny + 8, a1[r]);
  }
}

// Rows x[rows][d] times column blocks [p0, p1) of 16 (block p at wp + p * step, column k
// of it at + stride * k) into y (row r at y + r * ny, block p at + 16 p): rows in balanced
// passes of at most kMaxRows (8 rows: 4 + 4), each pass re-reading the block from cache.
void Blocks(int64_t rows, int64_t d, int64_t ny, const float* x, const float* wp, float* y,
            int64_t p0, int64_t p1, int64_t step, int64_t stride, int64_t ahead = 0) {
  const int64_t passes = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t per = (rows + passes - 1) / passes;
  for (int64_t p = p0; p < p1; ++p) {
    const float* w = wp + p * step;
    for (int64_t r0 = 0; r0 < rows; r0 += per) {
      const float* xr = x + r0 * d;
      float* yr = y + r0 * ny + kPanel * p;
      switch (rows - r0 < per ? rows - r0 : per) {
        case 1: Pass<1>(d, ny, xr, w, yr, stride, ahead); break;
        case 2: Pass<2>(d, ny, xr, w, yr, stride, ahead); break;
        case 3: Pass<3>(d, ny, xr, w, yr, stride, ahead); break;
        case 4: Pass<4>(d, ny, xr, w, yr, stride, ahead); break;
        case 5: Pass<5>(d, ny, xr, w, yr, stride, ahead); break;
        default: Pass<6>(d, ny, xr, w, yr, stride, ahead); break;
      }
    }
  }
}

// Panels [p0, p1) of a packed weight [P][d][16] for all rows.
void Panels(int64_t rows, int64_t d, int64_t panels, const float* x, const float* wp,
            float* y, int64_t p0, int64_t p1) {
  // 3 rows or more: software prefetch 64 k-steps (4 KB) ahead, so that the memory stream
  // keeps up while the passes' arithmetic grows (measured: T = 5 and 8 run 4-10 ms faster on
  // SmolLM2's chain; at 1-2 rows the hardware's prefetch alone is faster)
  const int64_t ahead = rows >= 3 ? 64 * kPanel : 0;
  Blocks(rows, d, kPanel * panels, x, wp, y, p0, p1, d * kPanel, kPanel, ahead);
}

// Runs fn(part) for part in [0, parts) on the calling thread and up to threads - 1 of the
// pool's (`threads`: at most `Threads(pool)`): parts are claimed in turn; the caller waits
// only for parts another thread has begun, so a busy pool never blocks it.
struct Job {
  std::function<void(int64_t)> fn;
  int64_t parts = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (int64_t part; (part = next.fetch_add(1)) < parts;) {
      fn(part);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

int64_t Threads(ffi::ThreadPool& pool) {
  static const int64_t cap = [] {  // $SPECJAX_ROW_KERNEL_THREADS: at most this many
    const char* env = std::getenv("SPECJAX_ROW_KERNEL_THREADS");
    return env != nullptr && std::atoi(env) > 0 ? int64_t{std::atoi(env)} : int64_t{1} << 20;
  }();
  return std::min<int64_t>(cap, std::max<int64_t>(pool.num_threads(), 1));
}

void ParallelFor(ffi::ThreadPool& pool, int64_t parts, int64_t threads,
                 std::function<void(int64_t)> fn) {
  if (parts <= 1 || threads <= 1) {
    for (int64_t part = 0; part < parts; ++part) fn(part);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = std::move(fn);
  job->parts = parts;
  for (int64_t i = 1; i < threads && i < parts; ++i) {
    pool.Schedule([job] { job->Work(); });  // a late task finds no part; shared_ptr
  }
  job->Work();
  for (int spins = 0; job->done.load(std::memory_order_acquire) < parts; ++spins) {
    if (spins > 4096) std::this_thread::yield();
  }
}

ffi::Error RowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                     ffi::Buffer<ffi::F32> wp, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = wp.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel ||
      wd[1] != xd[1] || yd[0] != xd[0] || yd[1] != kPanel * wd[0]) {
    return ffi::Error::InvalidArgument(
        "specjax_row_matmul: expected x [R, d], packed weight [P, d, 16], y [R, 16 P]");
  }
  const int64_t rows = xd[0], d = xd[1], panels = wd[0];
  const float* xp = x.typed_data();
  const float* w = wp.typed_data();
  float* yp = y->typed_data();
  // a weight under 256 KB stays on the calling thread; else ~4 parts per thread
  const int64_t threads = Threads(pool);
  const int64_t parts = panels * d * kPanel < (1 << 16)
                            ? 1 : std::min<int64_t>(panels, 4 * threads);
  ParallelFor(pool, parts, threads, [=](int64_t part) {
    Panels(rows, d, panels, xp, w, yp, panels * part / parts, panels * (part + 1) / parts);
  });
  return ffi::Error::Success();
}

// e^x for x <= 0 in 8 lanes (range reduction by ln 2, a degree-6 polynomial, the exponent
// built from bits; within 1 ulp of expf over [-87, 0]); below -87 it gives 0, and a positive
// x counts as 0.
inline v8 Exp8(v8 x) {
  typedef int32_t v8i __attribute__((vector_size(32)));
  const v8 zero = v8{}, low = zero - 87.0f;
  x = x > zero ? zero : x;
  const v8i dead = x < low;
  x = x < low ? low : x;
  const v8 shift = zero + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const v8 n = (x * 1.44269504088896341f + shift) - shift;
  const v8 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  v8 y = zero + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  y = y * scale;
  return dead ? zero : y;
}

// out[d] = sum over slots j < end with p[j] != 0 of p[j] * v[j][:], in slot order; D8 = d / 8
// accumulators held in registers.
template <int D8>
void Mix(int64_t end, const float* p, const float* v, float* out) {
  v8 acc[D8];
  for (int t = 0; t < D8; ++t) acc[t] = v8{};
  for (int64_t j = 0; j < end; ++j) {
    if (p[j] == 0.0f) continue;  // masked (or vanishing): never touches the slot's values
    const float e = p[j];
    const float* vj = v + j * 8 * D8;
    for (int t = 0; t < D8; ++t) acc[t] += e * load8(vj + 8 * t);
  }
  for (int t = 0; t < D8; ++t) store8(out + 8 * t, acc[t]);
}

void MixAny(int64_t end, int64_t d, const float* p, const float* v, float* out) {
  switch (d) {
    case 32: return Mix<4>(end, p, v, out);
    case 64: return Mix<8>(end, p, v, out);
    case 128: return Mix<16>(end, p, v, out);
    default: break;
  }
  std::fill(out, out + d, 0.0f);
  for (int64_t j = 0; j < end; ++j) {
    if (p[j] == 0.0f) continue;
    for (int64_t i = 0; i < d; ++i) out[i] += p[j] * v[j * d + i];
  }
}

// Attention of few query rows over a cache: q [rows, D] (scaled), keys [D, S], values
// [S, D], mask [rows, S] -> out [rows, D]. Only slots below the last visible one are read. A
// row's numbers depend on its own query and visible slots only (a score is one pass's sum
// over D, whatever block it falls in; exponentials lane by lane; sums in slot order), never
// on the number of rows or on the other rows, so a verified row equals the plain step's row
// bit for bit. A row that sees no slot gets zeros.
void AttendRows(int64_t rows, int64_t d, int64_t s, const float* q, const float* k,
                const float* v, const bool* mask, float* out) {
  int64_t end = 0;  // one past the last slot any row sees
  for (int64_t r = 0; r < rows; ++r) {
    const bool* m = mask + r * s;
    for (int64_t j = s - 1; j >= end; --j) {
      if (m[j]) {
        end = j + 1;
        break;
      }
    }
  }
  if (end == 0) {
    std::fill(out, out + rows * d, 0.0f);
    return;
  }
  // scores by the products' passes, 16 slots a block (keys [D, S]: a block's column i at
  // + S i); the buffer's last partial block from a zero-padded copy
  const int64_t blocks = (end + kPanel - 1) / kPanel, ld = blocks * kPanel;
  const int64_t whole = std::min(blocks, s / kPanel);
  std::unique_ptr<float[]> scores(new float[rows * ld]);
  float* sc = scores.get();
  Blocks(rows, d, ld, q, k, sc, 0, whole, kPanel, s, 8 * kPanel);  // 8 blocks ahead
  if (whole < blocks) {
    std::unique_ptr<float[]> tail(new float[d * kPanel]());
    for (int64_t i = 0; i < d; ++i) {
      for (int64_t j = whole * kPanel; j < s; ++j) {
        tail[i * kPanel + j - whole * kPanel] = k[i * s + j];
      }
    }
    Blocks(rows, d, ld, q, tail.get(), sc + whole * kPanel, 0, 1, 0, kPanel);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const bool* m = mask + r * s;
    float* p = sc + r * ld;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < end; ++j) {
      if (m[j] && p[j] > top) top = p[j];
    }
    if (top == -std::numeric_limits<float>::infinity()) {
      std::fill(out + r * d, out + r * d + d, 0.0f);
      continue;
    }
    for (int64_t j = 0; j < ld; j += 8) store8(p + j, Exp8(load8(p + j) - top));
    float total = 0.0f;
    for (int64_t j = 0; j < end; ++j) {
      p[j] = m[j] ? p[j] : 0.0f;
      total += p[j];
    }
    float* o = out + r * d;
    MixAny(end, d, p, v, o);
    const float inv = 1.0f / total;
    for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  }
}

ffi::Error RowAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask,
                        ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto md = mask.dimensions(), od = out->dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || md.size() != 3 || od.size() != 3 ||
      kd[0] != qd[0] || kd[1] != qd[2] || vd[0] != qd[0] || vd[1] != kd[2] || vd[2] != qd[2] ||
      md[0] != qd[0] || md[1] != qd[1] || md[2] != kd[2] || od[0] != qd[0] ||
      od[1] != qd[1] || od[2] != qd[2]) {
    return ffi::Error::InvalidArgument(
        "specjax_row_attention: expected q [N, R, D], keys [N, D, S], values [N, S, D], "
        "mask [N, R, S], out [N, R, D]");
  }
  const int64_t n = qd[0], rows = qd[1], d = qd[2], s = kd[2];
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  // parts: row blocks of each buffer row, about 4 per thread (a tiny cache stays on the
  // calling thread)
  const int64_t threads = n * d * s < (1 << 15) ? 1 : Threads(pool);
  const int64_t per = std::max<int64_t>(1, (n * rows + 4 * threads - 1) / (4 * threads));
  const int64_t blocks = (rows + per - 1) / per;
  ParallelFor(pool, n * blocks, threads, [&](int64_t part) {
    const int64_t i = part / blocks, r0 = part % blocks * per;
    const int64_t r1 = std::min(rows, r0 + per);
    AttendRows(r1 - r0, d, s, qp + (i * rows + r0) * d, kp + i * d * s, vp + i * s * d,
               mp + (i * rows + r0) * s, op + (i * rows + r0) * d);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowMatmul, RowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowAttention, RowAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
