// Parameter blocks of the Metal kernels, shared by the MSL sources (jq_metal.h), the
// bridge (metal_ffi.mm, which binds them with setBytes) and the CPU shim's tests.
// Every field is 4 bytes, so the layout is the same in MSL and C++ (and a flat
// uint32/float32 array on the Python side).
#pragma once
#ifdef __METAL_VERSION__
typedef uint jq_u32;
#else
#include <cstdint>
typedef uint32_t jq_u32;
#endif

// Quantized matmul y[s, m, :] = x[s / slots_per_x, m, :] @ W[e(s)].T (GEMV, gemv.metal)
// and y[b] = x[b] @ W[b].T (GEMM, qmm*.metal). W is [experts, n, k], canonical layout.
struct JqQmmParams {
  jq_u32 k;            // reduction length (a multiple of 32)
  jq_u32 n;            // output columns (rows of W)
  jq_u32 m;            // rows of x per slot (GEMV: <= 8)
  jq_u32 group_size;   // elements per scale
  jq_u32 experts;      // leading size of W
  jq_u32 slots;        // output slots (GEMV); batch (GEMM)
  jq_u32 slots_per_x;  // slots sharing one x (gather_qmm with 2-D x: the top-k)
  jq_u32 has_ids;      // 1: slot s uses expert ids[s] (read on the GPU); 0: expert s
};

struct JqDequantParams {
  jq_u32 rows;         // product of the leading dims and N
  jq_u32 k;
  jq_u32 group_size;
};

struct JqNormParams {
  jq_u32 rows;              // normalized segments (rows, or rows x groups)
  jq_u32 n;                 // elements per segment
  jq_u32 weight_period;     // weight index = (segment * n + i) % weight_period
  jq_u32 has_weight;
  float eps;
  float weight_offset;
  jq_u32 activation;        // gated: 0 silu, 1 sigmoid
  jq_u32 norm_before_gate;  // gated: 1 rms_norm(x) * act(gate), 0 rms_norm(x * act(gate))
};
