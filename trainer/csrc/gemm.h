// float32 matrix products for the shapes of a small model's decoding and GRPO update on the CPU.
//
// Two register-tiled loops, written with ATen's vector type (AVX-512 or AVX2, as torch itself was
// built for this CPU), threads sharing out whole output tiles:
//
//  - dot form, C = A B^T: each output is a dot product over a row of A and a row of B, both read
//    contiguously. A Linear's forward (B its weight, [out, in], as stored: nothing transposed or packed).
//  - broadcast form, C = A B with B [K, N] row-major: an element of A times a row of B, added into a
//    row of C. A Linear's input gradient (A = dY, B = W) and its weight gradient (A = dY^T, read
//    strided, and copied a block at a time into the order a tile reads it when it is large, B = X),
//    with the sum split into blocks of K so that A's and B's blocks stay in cache.
//
// On AVX2 every product, and on AVX-512 the forward, with enough rows takes a third, packed form
// instead (gemm.cpp's `gemm_packed`: B, and an A read down its columns, copied a block at a time into
// the order its 6-row register tile reads), measured faster than the loops above there (`packed`
// says where); `torch.ops.posttrain.gemm_form` sets one form for all.
//
// Every output element is summed by one thread in a fixed order (k ascending, in vector lanes then
// across them), whatever the thread count or timing: the results are the same bits from run to run.
#pragma once

#include <ATen/ATen.h>

namespace posttrain {

// C[m, n] (row stride ldc) = sum_k A[m, k] B[n, k] (+ bias[n]); A and B rows contiguous with strides lda, ldb.
void gemm_nt(const float* A, int64_t lda, const float* B, int64_t ldb, const float* bias, float* C, int64_t ldc,
             int64_t M, int64_t N, int64_t K);

// C[m, n] (row stride ldc) (+)= sum_k A(m, k) B[k, n], A(m, k) = A[m * sam + k * sak], B rows contiguous
// (stride ldb). `accumulate` adds to what C holds; otherwise C is overwritten.
void gemm_kn(const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t M,
             int64_t N, int64_t K, bool accumulate);

}  // namespace posttrain
