// The one translation unit built into rserve's kernel image (SASS for sm_90a plus PTX).
#include "paged_attention.cu"
#include "decode.cu"
#include "prefill.cu"
#include "gemv.cu"
#include "cache.cu"
#include "fused.cu"
#include "sampling.cu"
#include "fp8.cu"
