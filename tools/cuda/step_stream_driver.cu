// What the structure of a decode step costs, measured on a pure weight stream (no
// decode, no MMA: each product is a kernel that reads its matrix once). The matrices
// are Llama-3-8B's at 4 bits (affine, group 64, bf16 scale and bias: 0.5625 bytes a
// weight): per layer q/k/v 4096 -> 6144, o 4096 -> 4096, gate+up 4096 -> 28672, down
// 14336 -> 4096, each its own buffer, as a model's weights are. docs/decode.md, "What
// the step's structure costs", has the numbers and what they decide.
//
//   step_stream_driver [layers=32] [small=0]   the step's structure, read as
//     launches     one kernel per matrix, ordinary launches back to back;
//     PDL          the same as programmatic dependents (griddepcontrol.wait first);
//     graph        the launches captured in a CUDA graph (what XLA's command buffers
//                  replay), ordinary and programmatic; then programmatic with each
//                  thread's first loads issued before the wait (a matrix does not
//                  depend on the kernel before) or, instead, its first lines prefetched
//                  to L2 before the wait (a hint, safe whoever writes them);
//     persistent   one cooperative kernel, a grid barrier between matrices; with the
//                  next matrix's first lines prefetched to L2 before each barrier; with
//                  each thread's first loads of the next matrix issued into registers
//                  before the barrier and used after it; and without barriers (one
//                  stream: the rate with no boundaries at all).
//     `small` one-block kernels that touch no memory follow each matrix's kernel (the
//     step's norms, adds, RoPE: XLA's fusions, ordinary launches).
//   step_stream_driver next [A_MB=33] [B_MB=9.4] [gap_us=10]
//     read A, prefetching B to L2 at its end (one bulk prefetch per block, or a line
//     prefetch per thread) or not; a kernel that spins gap_us without memory (the
//     step's attention); then read B: does the next weight, prefetched by the kernel
//     before, come faster, and what does the prefetch cost that kernel?
//
// The bound is the bytes at the bandwidth of a 1 GiB device-to-device copy in the same
// process (read + write bytes / time), as `python -m jaxquant bench model` takes it.
// Build (sm_90: griddepcontrol and the L2 bulk prefetch):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 tools/cuda/step_stream_driver.cu -o step_stream_driver
// Not part of the library.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>

#include "cuda_check.h"  // CK

constexpr int kMaxMatrices = 512;
struct Matrices {
  const uint4* p[kMaxMatrices];
  unsigned long long n16[kMaxMatrices];  // 16-byte words
  int count;
};

// Elements [first, n16) of p in steps of `stride`, four 16-byte loads in flight a thread.
__device__ __forceinline__ uint32_t read_range(const uint4* p, size_t n16, size_t first,
                                               size_t stride) {
  uint32_t acc = 0;
  size_t i = first;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                   : "l"(p + i + j * stride));
#pragma unroll
    for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < n16; i += stride) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return acc;
}

// The thread's first four 16-byte words of p (zeros past its end).
__device__ __forceinline__ void first_loads(const uint4* p, size_t n16, size_t first, size_t stride,
                                            uint4 (&v)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const size_t i = first + j * stride;
    if (i < n16)
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                   : "l"(p + i));
    else
      v[j] = make_uint4(0, 0, 0, 0);
  }
}
__device__ __forceinline__ uint32_t fold(const uint4 (&v)[4]) {
  uint32_t acc = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  return acc;
}
__device__ __forceinline__ void first_lines_to_l2(const uint4* p, size_t n16, size_t first,
                                                  size_t stride) {
  for (int j = 0; j < 4; ++j)
    if (first + j * stride < n16) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + first + j * stride));
}

// The result only where it cannot be (keeps the loads).
__device__ __forceinline__ void sink(uint32_t acc, uint32_t* out) {
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;
}

enum Launch { kPlain = 0, kDependent = 1, kLoadsBeforeWait = 2, kL2BeforeWait = 3 };

// One matrix read by the grid. As a programmatic dependent (kDependent...) it waits for
// the kernel before first, as the decode GEMV waits for its x.
__global__ void read_kernel(const uint4* __restrict__ p, size_t n16, int launch, uint32_t* out) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  const size_t me = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  uint4 v[4];
  if (launch == kLoadsBeforeWait) first_loads(p, n16, me, stride, v);
  if (launch == kL2BeforeWait) first_lines_to_l2(p, n16, me, stride);
  if (launch != kPlain) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (launch == kLoadsBeforeWait) {
    acc = fold(v) ^ read_range(p, n16, me + 4 * stride, stride);
  } else {
    acc = read_range(p, n16, me, stride);
  }
  if (launch != kPlain) asm volatile("griddepcontrol.launch_dependents;");
  sink(acc, out);
}

// A stand-in for the step's small kernels: one block, no memory.
__global__ void small_kernel(uint32_t* out) {
  if (threadIdx.x == 1000) out[0] = 0;
}

// Every block of a cooperative grid arrives; none goes on before all have (the
// counter only grows: barrier k waits for k x blocks arrivals).
__device__ __forceinline__ void grid_barrier(uint32_t* counter, uint32_t target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    uint32_t seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}

enum Across { kNoBarrier = -1, kBarrier = 0, kL2AcrossBarrier = 1, kLoadsAcrossBarrier = 2 };

__global__ void persistent_kernel(const __grid_constant__ Matrices m, uint32_t* counter, int across,
                                  uint32_t* out) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  const size_t me = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  uint4 v[4];
  if (across == kLoadsAcrossBarrier) first_loads(m.p[0], m.n16[0], me, stride, v);
  for (int k = 0; k < m.count; ++k) {
    if (across == kLoadsAcrossBarrier)
      acc ^= fold(v) ^ read_range(m.p[k], m.n16[k], me + 4 * stride, stride);
    else
      acc ^= read_range(m.p[k], m.n16[k], me, stride);
    if (k + 1 == m.count || across == kNoBarrier) continue;
    if (across == kL2AcrossBarrier) first_lines_to_l2(m.p[k + 1], m.n16[k + 1], me, stride);
    if (across == kLoadsAcrossBarrier) first_loads(m.p[k + 1], m.n16[k + 1], me, stride, v);
    grid_barrier(counter, (uint32_t)(k + 1) * gridDim.x);
  }
  sink(acc, out);
}

// next: read A (prefetching B to L2 at the end, or not), then B.
__global__ void read_then_prefetch(const uint4* __restrict__ p, size_t n16, const char* pf,
                                   size_t pf_bytes, int mode, uint32_t* out) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  const uint32_t acc = read_range(p, n16, (size_t)blockIdx.x * blockDim.x + threadIdx.x, stride);
  if (mode == 1 && threadIdx.x == 0) {  // the block's slice of B, bulk prefetches of 64 KB
    const size_t per = (pf_bytes / gridDim.x + 15) / 16 * 16, b0 = (size_t)blockIdx.x * per;
    for (size_t o = b0; o < b0 + per && o < pf_bytes; o += 65536) {
      size_t len = b0 + per - o;
      len = len > 65536 ? 65536 : len;
      len = (o + len > pf_bytes ? pf_bytes - o : len) & ~(size_t)15;
      if (len)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pf + o), "r"((uint32_t)len)
                     : "memory");
    }
  } else if (mode == 2) {  // a line prefetch per thread
    for (size_t l = (size_t)blockIdx.x * blockDim.x + threadIdx.x; l < pf_bytes / 128; l += stride)
      asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(pf + l * 128));
  }
  sink(acc, out);
}
__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

struct Timer {
  cudaStream_t st;
  cudaEvent_t e0, e1;
  explicit Timer(cudaStream_t s) : st(s) {
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
  }
  template <class F>
  double us(F&& fn, int iters) {  // per call, after 3 untimed
    for (int i = 0; i < 3; ++i) fn();
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < iters; ++i) fn();
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return 1e3 * ms / iters;
  }
};

static double copy_bandwidth(cudaStream_t st) {  // bytes/s, read + write
  const size_t bytes = size_t(1) << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  Timer t(st);
  const double us = t.us([&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st)); }, 10);
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * bytes / (us * 1e-6);
}

static int step(int layers, int smalls) {
  if (layers < 1 || 4 * layers > kMaxMatrices) {
    printf("layers must be in [1, %d]\n", kMaxMatrices / 4);
    return 2;
  }
  const double weights[4] = {4096.0 * 6144, 4096.0 * 4096, 4096.0 * 28672, 14336.0 * 4096};
  Matrices m;
  m.count = 4 * layers;
  double total = 0;
  for (int i = 0; i < m.count; ++i) {
    const size_t bytes = (size_t)(weights[i % 4] * 0.5625) / 16 * 16;
    void* p;
    CK(cudaMalloc(&p, bytes));
    CK(cudaMemset(p, i, bytes));
    m.p[i] = static_cast<const uint4*>(p);
    m.n16[i] = bytes / 16;
    total += bytes;
  }
  uint32_t *out, *counter;
  CK(cudaMalloc(&out, 1 << 20));
  CK(cudaMalloc(&counter, 4));
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  const int threads = 256, grid = 4 * sms;
  int resident;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, persistent_kernel, threads, 0));
  if (resident * sms < grid) {
    printf("the persistent grid (%d blocks) does not fit (%d an SM)\n", grid, resident);
    return 1;
  }
  const double bw = copy_bandwidth(st), bound = total / bw * 1e6;
  printf("%d matrices, %.1f MB, %d small kernels after each; copy %.0f GB/s; bound %.1f us\n",
         m.count, total / 1e6, smalls, bw / 1e9, bound);

  auto launches = [&](int launch) {
    for (int i = 0; i < m.count; ++i) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(grid);
      cfg.blockDim = dim3(threads);
      cfg.stream = st;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = attr;
      cfg.numAttrs = launch == kPlain ? 0 : 1;
      CK(cudaLaunchKernelEx(&cfg, read_kernel, m.p[i], (size_t)m.n16[i], launch, out));
      for (int j = 0; j < smalls; ++j) small_kernel<<<1, 32, 0, st>>>(out);
    }
  };
  cudaGraphExec_t graphs[4];
  for (int launch = 0; launch < 4; ++launch) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    launches(launch);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&graphs[launch], g, 0));
  }
  auto persistent = [&](int across) {
    CK(cudaMemsetAsync(counter, 0, 4, st));
    Matrices* mp = &m;
    void* args[] = {(void*)mp, (void*)&counter, (void*)&across, (void*)&out};
    CK(cudaLaunchCooperativeKernel((void*)persistent_kernel, dim3(grid), dim3(threads), args, 0, st));
  };
  struct Row {
    const char* name;
    double us;
  };
  Timer t(st);
  for (int rep = 0; rep < 3; ++rep) {
    const Row rows[] = {
        {"launches", t.us([&] { launches(kPlain); }, 20)},
        {"PDL", t.us([&] { launches(kDependent); }, 20)},
        {"graph", t.us([&] { CK(cudaGraphLaunch(graphs[kPlain], st)); }, 20)},
        {"graph PDL", t.us([&] { CK(cudaGraphLaunch(graphs[kDependent], st)); }, 20)},
        {"graph PDL, loads before the wait", t.us([&] { CK(cudaGraphLaunch(graphs[kLoadsBeforeWait], st)); }, 20)},
        {"graph PDL, L2 prefetch before the wait", t.us([&] { CK(cudaGraphLaunch(graphs[kL2BeforeWait], st)); }, 20)},
        {"persistent, barriers", t.us([&] { persistent(kBarrier); }, 20)},
        {"persistent, L2 prefetch before each barrier", t.us([&] { persistent(kL2AcrossBarrier); }, 20)},
        {"persistent, loads across each barrier", t.us([&] { persistent(kLoadsAcrossBarrier); }, 20)},
        {"persistent, no barriers", t.us([&] { persistent(kNoBarrier); }, 20)},
    };
    printf("turn %d:", rep);
    for (const Row& r : rows) printf("  %s %.1f us (%.0f%%);", r.name, r.us, 100 * bound / r.us);
    printf("\n");
  }
  return 0;
}

static int next(double a_mb, double b_mb, double gap_us) {
  const size_t a_bytes = (size_t)(a_mb * 1e6) / 16 * 16, b_bytes = (size_t)(b_mb * 1e6) / 16 * 16;
  constexpr int kSets = 8, kIters = 200;  // sets cycled through: none is in L2 when read
  std::vector<char*> a(kSets), b(kSets);
  for (int s = 0; s < kSets; ++s) {
    CK(cudaMalloc(&a[s], a_bytes));
    CK(cudaMalloc(&b[s], b_bytes));
    CK(cudaMemset(a[s], s, a_bytes));
    CK(cudaMemset(b[s], s + 1, b_bytes));
  }
  uint32_t* out;
  CK(cudaMalloc(&out, 1 << 20));
  int sms, khz;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaEvent_t ev[4];
  for (cudaEvent_t& e : ev) CK(cudaEventCreate(&e));
  const long long spin = (long long)(gap_us * khz / 1000.0);
  const char* names[3] = {"none", "bulk", "lines"};
  for (int rep = 0; rep < 2; ++rep)
    for (int mode = 0; mode < 3; ++mode) {
      double ta = 0, tb = 0, tall = 0;
      for (int it = -20; it < kIters; ++it) {
        const int s = (it + 40) % kSets;
        CK(cudaEventRecord(ev[0], st));
        read_then_prefetch<<<4 * sms, 256, 0, st>>>(reinterpret_cast<const uint4*>(a[s]), a_bytes / 16,
                                                   b[s], b_bytes, mode, out);
        CK(cudaEventRecord(ev[1], st));
        if (gap_us > 0) spin_kernel<<<1, 32, 0, st>>>(spin);
        CK(cudaEventRecord(ev[2], st));
        read_then_prefetch<<<4 * sms, 256, 0, st>>>(reinterpret_cast<const uint4*>(b[s]), b_bytes / 16,
                                                   nullptr, 0, 0, out);
        CK(cudaEventRecord(ev[3], st));
        CK(cudaEventSynchronize(ev[3]));
        if (it < 0) continue;
        float x;
        CK(cudaEventElapsedTime(&x, ev[0], ev[1]));
        ta += x;
        CK(cudaEventElapsedTime(&x, ev[2], ev[3]));
        tb += x;
        CK(cudaEventElapsedTime(&x, ev[0], ev[3]));
        tall += x;
      }
      printf("turn %d prefetch %-5s: A (%.1f MB) %.2f us, B (%.1f MB) %.2f us, all (gap %.0f us) %.2f us\n",
             rep, names[mode], a_mb, 1e3 * ta / kIters, b_mb, 1e3 * tb / kIters, gap_us,
             1e3 * tall / kIters);
    }
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], "next") == 0)
    return next(argc > 2 ? atof(argv[2]) : 33.0, argc > 3 ? atof(argv[3]) : 9.4,
                argc > 4 ? atof(argv[4]) : 10.0);
  return step(argc > 1 ? atoi(argv[1]) : 32, argc > 2 ? atoi(argv[2]) : 0);
}
