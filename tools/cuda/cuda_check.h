// CK(expr): a CUDA runtime call's error, printed with its line, ends the program. For
// the CUDA developer drivers under tools/cuda (not part of the library).
#pragma once

#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

#define CK(x)                                                                           \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      printf("error %s at line %d\n", cudaGetErrorString(e_), __LINE__);                \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)
