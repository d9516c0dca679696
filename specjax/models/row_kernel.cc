// Few-row float32 products for XLA:CPU: y[R, 16 P] = x[R, d] @ W, the weight packed as
// panels Wp[P][d][16] (column block p of W, row by row). See row_kernel.py for why.
//
// Each panel is streamed once, front to back; the R rows' accumulators (two 8-wide vectors
// per row, up to 6 rows per pass) stay in registers over the whole contraction, so the
// weight is read from memory once whatever R is, and R adds only arithmetic. A row's sum
// runs over k in the same order whatever R is and whichever pass holds it, so a row's result
// is bit-identical between a one-row call and a many-row call (plain decoding and
// verification compute the same numbers). A large weight's panels are split into parts
// shared out over XLA's intra-op thread pool; the calling thread claims parts too and only
// waits for parts another thread has begun, so a busy pool never blocks it. Each panel is
// computed whole by one thread.
//
// Portable C++ (GCC/Clang vector extensions, no intrinsics): built on the user's machine
// with -O3 -march=native, it takes that machine's vector width.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <atomic>
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

template <int R>
inline void Pass(int64_t d, int64_t ny, const float* x, const float* wp, float* y) {
  v8 a0[R], a1[R];
  for (int r = 0; r < R; ++r) {
    a0[r] = v8{} ;
    a1[r] = v8{};
  }
  for (int64_t k = 0; k < d; ++k) {
    const v8 w0 = load8(wp + kPanel * k), w1 = load8(wp + kPanel * k + 8);
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

// Panels [p0, p1) for all rows: rows in balanced passes of at most kMaxRows (8 rows: 4 + 4),
// each pass re-reading the panel from cache.
void Panels(int64_t rows, int64_t d, int64_t panels, const float* x, const float* wp,
            float* y, int64_t p0, int64_t p1) {
  const int64_t ny = kPanel * panels;
  const int64_t passes = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t per = (rows + passes - 1) / passes;
  for (int64_t p = p0; p < p1; ++p) {
    const float* w = wp + p * d * kPanel;
    for (int64_t r0 = 0; r0 < rows; r0 += per) {
      const float* xr = x + r0 * d;
      float* yr = y + r0 * ny + kPanel * p;
      switch (rows - r0 < per ? rows - r0 : per) {
        case 1: Pass<1>(d, ny, xr, w, yr); break;
        case 2: Pass<2>(d, ny, xr, w, yr); break;
        case 3: Pass<3>(d, ny, xr, w, yr); break;
        case 4: Pass<4>(d, ny, xr, w, yr); break;
        case 5: Pass<5>(d, ny, xr, w, yr); break;
        default: Pass<6>(d, ny, xr, w, yr); break;
      }
    }
  }
}

struct Job {
  int64_t rows, d, panels, parts;
  const float* x;
  const float* wp;
  float* y;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (int64_t part; (part = next.fetch_add(1)) < parts;) {
      Panels(rows, d, panels, x, wp, y, panels * part / parts, panels * (part + 1) / parts);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error RowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                     ffi::Buffer<ffi::F32> wp, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = wp.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel ||
      wd[1] != xd[1] || yd[0] != xd[0] || yd[1] != kPanel * wd[0]) {
    return ffi::Error::InvalidArgument(
        "specjax_row_matmul: expected x [R, d], packed weight [P, d, 16], y [R, 16 P]");
  }
  auto job = std::make_shared<Job>();
  job->rows = xd[0];
  job->d = xd[1];
  job->panels = wd[0];
  job->x = x.typed_data();
  job->wp = wp.typed_data();
  job->y = y->typed_data();
  static const int64_t cap = [] {  // $SPECJAX_ROW_KERNEL_THREADS: at most this many
    const char* env = std::getenv("SPECJAX_ROW_KERNEL_THREADS");
    return env != nullptr && std::atoi(env) > 0 ? int64_t{std::atoi(env)} : int64_t{1} << 20;
  }();
  const int64_t threads = std::min<int64_t>(cap, std::max<int64_t>(pool.num_threads(), 1));
  // a weight under 256 KB stays on the calling thread; else ~4 parts per thread, claimed
  // in turn by the calling thread and the pool's tasks
  job->parts = job->panels * job->d * kPanel < (1 << 16)
                   ? 1 : std::min<int64_t>(job->panels, 4 * threads);
  for (int64_t i = 1; i < threads && i < job->parts; ++i) {
    pool.Schedule([job] { job->Work(); });  // a late task finds no part; shared_ptr
  }
  job->Work();  // then wait only for parts another thread has begun
  for (int spins = 0; job->done.load(std::memory_order_acquire) < job->parts; ++spins) {
    if (spins > 4096) std::this_thread::yield();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowMatmul, RowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
