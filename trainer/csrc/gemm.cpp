// See gemm.h. Registered as torch.ops.posttrain.linear_fwd / linears_fwd / linear_dx / linears_dx /
// linear_dw for trainer/fasttrain.py's Linear and trainer/inference/cpu.py's prefill and output head;
// decode_layer.cpp calls gemm_nt directly.

#include "gemm.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace posttrain {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
// tiles sized to the vector registers: 32 with AVX-512, 16 with AVX2 (accumulators + operands)
constexpr int NT_MR = W >= 16 ? 4 : 3;  // rows of A
constexpr int NT_NR = W >= 16 ? 4 : 3;  // rows of B
constexpr int KN_MR = W >= 16 ? 8 : 4;  // rows of C
constexpr int KN_NV = 3;                // vectors of C's columns
constexpr int64_t NT_MB = 64;           // rows of A a task keeps in cache
constexpr int64_t NT_NCHUNK = 16;       // tiles of B a task takes
constexpr int64_t KN_MB = 512;          // rows of C a task keeps in cache
constexpr int64_t KN_KB = 256;          // rows of B summed before C is written
constexpr int64_t PK_ROWS = 256;        // rows of C from which the packed form runs (`packed`)
constexpr int64_t PK_ROWS_BY_COLUMNS = 64;  // the same, A read down its columns

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

template <int MR, int NR>
void nt_tile(const float* A, int64_t lda, const float* B, int64_t ldb, const float* bias, float* C, int64_t ldc,
             int64_t K) {
  Vec acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = Vec(0.f);
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    Vec b[NR];
    for (int j = 0; j < NR; ++j) b[j] = Vec::loadu(B + j * ldb + k);
    for (int r = 0; r < MR; ++r) {
      const Vec a = Vec::loadu(A + r * lda + k);
      for (int j = 0; j < NR; ++j) acc[r][j] = at::vec::fmadd(a, b[j], acc[r][j]);
    }
  }
  if (k < K) {  // the last partial vector, zero-filled past K
    const int64_t n = K - k;
    Vec b[NR];
    for (int j = 0; j < NR; ++j) b[j] = Vec::loadu(B + j * ldb + k, n);
    for (int r = 0; r < MR; ++r) {
      const Vec a = Vec::loadu(A + r * lda + k, n);
      for (int j = 0; j < NR; ++j) acc[r][j] = at::vec::fmadd(a, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) C[r * ldc + j] = bias ? hsum(acc[r][j]) + bias[j] : hsum(acc[r][j]);
}

template <int MR>
void nt_cols(int nr, const float* A, int64_t lda, const float* B, int64_t ldb, const float* bias, float* C,
             int64_t ldc, int64_t K) {
  switch (nr) {
    case 1: return nt_tile<MR, 1>(A, lda, B, ldb, bias, C, ldc, K);
    case 2: return nt_tile<MR, 2>(A, lda, B, ldb, bias, C, ldc, K);
    case 3: return nt_tile<MR, 3>(A, lda, B, ldb, bias, C, ldc, K);
    default: return nt_tile<MR, NT_NR>(A, lda, B, ldb, bias, C, ldc, K);
  }
}

void nt_any(int mr, int nr, const float* A, int64_t lda, const float* B, int64_t ldb, const float* bias, float* C,
            int64_t ldc, int64_t K) {
  switch (mr) {
    case 1: return nt_cols<1>(nr, A, lda, B, ldb, bias, C, ldc, K);
    case 2: return nt_cols<2>(nr, A, lda, B, ldb, bias, C, ldc, K);
    case 3: return nt_cols<3>(nr, A, lda, B, ldb, bias, C, ldc, K);
    default: return nt_cols<NT_MR>(nr, A, lda, B, ldb, bias, C, ldc, K);
  }
}

// C tile [MR, NV vectors] (+)= A(MR rows, K) B[K, NV vectors]; `last` lanes of the last vector are real.
template <int MR, int NV, bool FULL>
void kn_tile(const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t K,
             int64_t last, bool accumulate) {
  Vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      const bool part = !FULL && v == NV - 1;
      acc[r][v] = !accumulate ? Vec(0.f) : part ? Vec::loadu(C + r * ldc + v * W, last) : Vec::loadu(C + r * ldc + v * W);
    }
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    Vec bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = (!FULL && v == NV - 1) ? Vec::loadu(b + v * W, last) : Vec::loadu(b + v * W);
    const float* a = A + k * sak;
    for (int r = 0; r < MR; ++r) {
      const Vec ar(a[r * sam]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(ar, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      if (!FULL && v == NV - 1) {
        acc[r][v].store(C + r * ldc + v * W, last);
      } else {
        acc[r][v].store(C + r * ldc + v * W);
      }
    }
}

template <int MR, int NV>
void kn_full(bool full, const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb, float* C, int64_t ldc,
             int64_t K, int64_t last, bool accumulate) {
  if (full) return kn_tile<MR, NV, true>(A, sam, sak, B, ldb, C, ldc, K, last, accumulate);
  return kn_tile<MR, NV, false>(A, sam, sak, B, ldb, C, ldc, K, last, accumulate);
}

template <int MR>
void kn_cols(int nv, bool full, const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb, float* C,
             int64_t ldc, int64_t K, int64_t last, bool accumulate) {
  switch (nv) {
    case 1: return kn_full<MR, 1>(full, A, sam, sak, B, ldb, C, ldc, K, last, accumulate);
    case 2: return kn_full<MR, 2>(full, A, sam, sak, B, ldb, C, ldc, K, last, accumulate);
    default: return kn_full<MR, KN_NV>(full, A, sam, sak, B, ldb, C, ldc, K, last, accumulate);
  }
}

void kn_any(int mr, int nv, bool full, const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb,
            float* C, int64_t ldc, int64_t K, int64_t last, bool accumulate) {
  switch (mr) {
#define POSTTRAIN_KN_CASE(n) \
  case n: return kn_cols<(n < KN_MR ? n : KN_MR)>(nv, full, A, sam, sak, B, ldb, C, ldc, K, last, accumulate);
    POSTTRAIN_KN_CASE(1)
    POSTTRAIN_KN_CASE(2)
    POSTTRAIN_KN_CASE(3)
    POSTTRAIN_KN_CASE(4)
    POSTTRAIN_KN_CASE(5)
    POSTTRAIN_KN_CASE(6)
    POSTTRAIN_KN_CASE(7)
#undef POSTTRAIN_KN_CASE
    default: return kn_cols<KN_MR>(nv, full, A, sam, sak, B, ldb, C, ldc, K, last, accumulate);
  }
}


// The packed form: C[M, N] (+)= sum_k A(m, k) B(k, n), each operand read through its two strides.
// B is copied, a block of PK_KC rows and up to PK_NC columns at a time, into panels of PK_NR columns
// in the order the inner loop reads them (GotoBLAS's scheme), zero-filled past its last column. An A
// read along its rows (x, dY) is read where it is, six rows at a time; one read down its columns (dY^T,
// each k a row of dY that may be a vocabulary wide) is copied a thread's block at a time into panels
// of six rows, the order the inner loop reads, rather than touching a new page every k. The
// inner loop broadcasts an element of each of A's six rows against two vectors of B's panel and keeps
// a 6 x 2-vector tile of C in registers (12 of AVX2's 16), B's panel staying in L1 and a thread's
// block of A's rows in L2. Each output is one chain of fused multiply-adds, k ascending, starting from
// what C holds after the blocks before: the same bits whatever the block sizes, the thread count or
// which rows share a call.
constexpr int PK_MR = 6;                 // rows of C in registers
constexpr int PK_NV = 2;                 // vectors of C's columns in registers
constexpr int64_t PK_NR = PK_NV * W;     // columns of a panel of B
constexpr int64_t PK_KC = 256;           // rows of B packed at once: a panel of B is KC x NR
constexpr int64_t PK_NC = 1024;          // columns of B packed at once
constexpr int64_t PK_MC = 144;           // rows of A a thread takes at once (they stay in L2)

std::atomic<int> g_form{0};  // 0 auto, 1 packed wherever it can run, 2 the register-tiled loops only

// A's rows m0.. (rows of them, the rest zero) x columns k0..k0+kc, A read down its columns (sam 1), into
// panels of MR rows (a register tile's: PK_MR for the packed form, KN_MR for gemm_kn's): dst[(panel, k, r)]
template <int MR>
void pack_a(const float* A, int64_t sak, int64_t m0, int64_t rows, int64_t k0, int64_t kc, float* dst) {
  for (int64_t p = 0; p * MR < rows; ++p, dst += kc * MR) {
    const int64_t mr = std::min<int64_t>(MR, rows - p * MR);
    const float* src = A + m0 + p * MR + k0 * sak;
    for (int64_t k = 0; k < kc; ++k)
      for (int64_t r = 0; r < MR; ++r) dst[k * MR + r] = r < mr ? src[k * sak + r] : 0.f;
  }
}

// B's rows k0..k0+kc x columns n0.. (cols of them, the rest zero) as one panel of PK_NR columns: dst[(k, j)]
void pack_b(const float* B, int64_t sbk, int64_t sbn, int64_t k0, int64_t kc, int64_t n0, int64_t cols, float* dst) {
  const float* src = B + k0 * sbk + n0 * sbn;
  if (sbn == 1) {  // B's rows contiguous: copy row pieces
    for (int64_t k = 0; k < kc; ++k) {
      std::copy(src + k * sbk, src + k * sbk + cols, dst + k * PK_NR);
      std::fill(dst + k * PK_NR + cols, dst + (k + 1) * PK_NR, 0.f);
    }
  } else if (sbk == 1) {  // B(k, n) = W[n, k] (a Linear's weight as stored): a block of W transposed
    at::vec::transpose_mxn<float>(src, sbn, dst, PK_NR, static_cast<int>(cols), static_cast<int>(kc));
    if (cols < PK_NR)
      for (int64_t k = 0; k < kc; ++k) std::fill(dst + k * PK_NR + cols, dst + (k + 1) * PK_NR, 0.f);
  } else {
    for (int64_t j = 0; j < PK_NR; ++j)
      for (int64_t k = 0; k < kc; ++k) dst[k * PK_NR + j] = j < cols ? src[j * sbn + k * sbk] : 0.f;
  }
}

// a PK_MR x PK_NR tile of C (row stride ldc) (+)= A's six rows (A(r, k) = A[r * sam + k * sak]; ROWS:
// sak is 1, else sam is) x B's panel, over kc
template <bool FROM_C, bool ROWS>
void pk_tile(int64_t kc, const float* A, int64_t sam, int64_t sak, const float* Bp, float* C, int64_t ldc) {
  Vec c[PK_MR][PK_NV];
  for (int r = 0; r < PK_MR; ++r)
    for (int v = 0; v < PK_NV; ++v) c[r][v] = FROM_C ? Vec::loadu(C + r * ldc + v * W) : Vec(0.f);
  const float* row[PK_MR];
  for (int r = 0; r < PK_MR; ++r) row[r] = A + r * sam;
  for (int64_t k = 0; k < kc; ++k, Bp += PK_NR) {
    Vec b[PK_NV];
    for (int v = 0; v < PK_NV; ++v) b[v] = Vec::loadu(Bp + v * W);
    const float* col = A + k * sak;
    for (int r = 0; r < PK_MR; ++r) {
      const Vec a(ROWS ? row[r][k] : col[r]);
      for (int v = 0; v < PK_NV; ++v) c[r][v] = at::vec::fmadd(a, b[v], c[r][v]);
    }
  }
  for (int r = 0; r < PK_MR; ++r)
    for (int v = 0; v < PK_NV; ++v) c[r][v].store(C + r * ldc + v * W);
}

template <bool FROM_C>
void pk_any(bool rows, int64_t kc, const float* A, int64_t sam, int64_t sak, const float* Bp, float* C, int64_t ldc) {
  if (rows) return pk_tile<FROM_C, true>(kc, A, sam, sak, Bp, C, ldc);
  return pk_tile<FROM_C, false>(kc, A, sam, sak, Bp, C, ldc);
}

void gemm_packed(const float* A, int64_t sam, int64_t sak, const float* B, int64_t sbk, int64_t sbn,
                 const float* bias, float* C, int64_t ldc, int64_t M, int64_t N, int64_t K, bool accumulate) {
  if (K == 0) {  // an empty sum (plus the bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) C[m * ldc + n] = (accumulate ? C[m * ldc + n] : 0.f) + (bias ? bias[n] : 0.f);
    return;
  }
  const bool rows = sak == 1;
  // blocks of at most PK_MC rows, as many for each thread (the block size changes no bits)
  const int64_t threads = at::get_num_threads();
  const int64_t mc = at::divup(at::divup(M, threads * at::divup(M, threads * PK_MC)), PK_MR) * PK_MR;
  const int64_t m_blocks = at::divup(M, mc);
  // B's packed block, every element written by pack_b before it is read (so left uninitialised)
  const std::unique_ptr<float[]> Bp(new float[PK_KC * std::min<int64_t>(PK_NC, at::divup(N, PK_NR) * PK_NR)]);
  for (int64_t jc = 0; jc < N; jc += PK_NC) {
    const int64_t nc = std::min(PK_NC, N - jc), panels = at::divup(nc, PK_NR);
    for (int64_t pc = 0; pc < K; pc += PK_KC) {
      const int64_t kc = std::min(PK_KC, K - pc);
      at::parallel_for(0, panels, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t q = lo; q < hi; ++q)
          pack_b(B, sbk, sbn, pc, kc, jc + q * PK_NR, std::min(PK_NR, nc - q * PK_NR), Bp.get() + q * kc * PK_NR);
      });
      const bool from_c = accumulate || pc > 0;
      const float* last_bias = pc + kc == K ? bias : nullptr;
      at::parallel_for(0, m_blocks, 1, [&](int64_t lo, int64_t hi) {
        thread_local std::vector<float> Ap;  // a block of A read down its columns, packed
        if (!rows) Ap.resize(static_cast<size_t>(PK_MC * PK_KC));
        float edge_a[PK_MR * PK_KC];  // the last rows of A when fewer than six, zero-filled: by columns, sak 6
        float edge_c[PK_MR * PK_NR];
        for (int64_t ib = lo; ib < hi; ++ib) {
          const int64_t m_lo = ib * mc, m_hi = std::min(M, m_lo + mc);
          if (!rows) pack_a<PK_MR>(A, sak, m_lo, m_hi - m_lo, pc, kc, Ap.data());
          for (int64_t q = 0; q < panels; ++q) {
            const int64_t n0 = jc + q * PK_NR, nr = std::min(PK_NR, jc + nc - n0);
            const float* bp = Bp.get() + q * kc * PK_NR;
            for (int64_t m0 = m_lo; m0 < m_hi; m0 += PK_MR) {
              const int64_t mr = std::min<int64_t>(PK_MR, m_hi - m0);
              // A's six rows: in place (sak 1), or their packed panel (sam 1, sak 6, zero past the last row)
              const float* a = rows ? A + m0 * sam + pc : Ap.data() + (m0 - m_lo) * kc;
              const int64_t asam = rows ? sam : 1, asak = rows ? 1 : PK_MR;
              float* c = C + m0 * ldc + n0;
              if (mr == PK_MR && nr == PK_NR) {
                from_c ? pk_any<true>(rows, kc, a, asam, asak, bp, c, ldc)
                       : pk_any<false>(rows, kc, a, asam, asak, bp, c, ldc);
              } else {  // an edge tile: through full-size copies, only its real part written back
                const float* ea = a;
                int64_t esam = asam, esak = asak;
                if (mr < PK_MR && rows) {
                  for (int64_t k = 0; k < kc; ++k)
                    for (int64_t r = 0; r < PK_MR; ++r) edge_a[k * PK_MR + r] = r < mr ? a[r * sam + k] : 0.f;
                  ea = edge_a, esam = 1, esak = PK_MR;
                }
                for (int64_t r = 0; r < PK_MR; ++r)
                  for (int64_t j = 0; j < PK_NR; ++j) edge_c[r * PK_NR + j] = from_c && r < mr && j < nr ? c[r * ldc + j] : 0.f;
                pk_any<true>(esak == 1, kc, ea, esam, esak, bp, edge_c, PK_NR);
                for (int64_t r = 0; r < mr; ++r) std::copy(edge_c + r * PK_NR, edge_c + r * PK_NR + nr, c + r * ldc);
              }
              if (last_bias)
                for (int64_t r = 0; r < mr; ++r)
                  for (int64_t j = 0; j < nr; ++j) c[r * ldc + j] += last_bias[n0 + j];
            }
          }
        }
      });
    }
  }
}

// Which product a call computes, for `packed` below.
enum class Product { kForward, kInputGrad, kWeightGrad };

// Whether a product takes the packed form. Auto, by the rates measured on each kind
// (docs/performance.md): on AVX2 the tiled loops reach about half of MKL's rate on the training
// shapes and the packed form about MKL's, so every product with rows enough takes it. On AVX-512
// (Intel's Xeon with MKL's AVX-512 path, and AMD's Zen 4) the packed form ran the forward 1.1-2.5x
// the tiled loops' rate, most on a short sum (a 128-wide layer, where the tiled loop's sums across
// a vector cost most), and the gradients no faster (the weight gradient's loops copy a strided A
// themselves), so the forward takes it, unless B has many more rows than A (an output head over a
// vocabulary: its copy costs more than it saves, measured up to a thousand rows of A). From rows
// enough to pay for packing B (a decoding step's few rows read each weight once, as stored), and
// for A read down its columns (a weight's gradient, dY^T X) from fewer: the tiled loop reads such an
// A a few floats a cache line. The rule names no vendor: one ISA, the same bits on every CPU.
bool packed(int64_t M, int64_t N, int64_t K, Product p) {
  const int form = g_form.load(std::memory_order_relaxed);
  if (form != 0) return form == 1;
  const bool takes = W == 8 || (p == Product::kForward && N <= 32 * M);
  return takes && M >= (p == Product::kWeightGrad ? PK_ROWS_BY_COLUMNS : PK_ROWS) && N >= PK_NR && K >= W;
}

}  // namespace

void gemm_nt(const float* A, int64_t lda, const float* B, int64_t ldb, const float* bias, float* C, int64_t ldc,
             int64_t M, int64_t N, int64_t K) {
  if (packed(M, N, K, Product::kForward)) return gemm_packed(A, lda, 1, B, 1, ldb, bias, C, ldc, M, N, K, false);
  const int64_t n_tiles = (N + NT_NR - 1) / NT_NR;
  const int64_t n_chunks = (n_tiles + NT_NCHUNK - 1) / NT_NCHUNK, m_blocks = (M + NT_MB - 1) / NT_MB;
  // a task: one block of A's rows against a chunk of B's tiles (disjoint parts of C); a thread takes
  // consecutive tasks, every block of A against one chunk before the next, so that B (an output head's
  // weight, a vocabulary of rows) is read from memory once, not once per block of A
  at::parallel_for(0, m_blocks * n_chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t m_lo = (task % m_blocks) * NT_MB, m_hi = std::min(M, m_lo + NT_MB);
      const int64_t t_lo = (task / m_blocks) * NT_NCHUNK, t_hi = std::min(n_tiles, t_lo + NT_NCHUNK);
      for (int64_t t = t_lo; t < t_hi; ++t) {
        const int64_t n0 = t * NT_NR;
        const int nr = static_cast<int>(std::min<int64_t>(NT_NR, N - n0));
        for (int64_t m0 = m_lo; m0 < m_hi; m0 += NT_MR) {
          const int mr = static_cast<int>(std::min<int64_t>(NT_MR, m_hi - m0));
          nt_any(mr, nr, A + m0 * lda, lda, B + n0 * ldb, ldb, bias ? bias + n0 : nullptr, C + m0 * ldc + n0, ldc, K);
        }
      }
    }
  });
}

void gemm_kn(const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t M,
             int64_t N, int64_t K, bool accumulate) {
  const Product p = sak != 1 ? Product::kWeightGrad : Product::kInputGrad;  // A read down its columns: dY^T
  if (packed(M, N, K, p)) return gemm_packed(A, sam, sak, B, ldb, 1, nullptr, C, ldc, M, N, K, accumulate);
  constexpr int64_t TW = KN_NV * W;  // columns of a tile
  // blocks of at most KN_MB rows, as many for each thread, so that a few column tiles (a weight's
  // gradient, C a few hundred wide) still share out evenly; the block size changes no bits
  const int64_t threads = at::get_num_threads();
  const int64_t m_blocks = threads * at::divup(at::divup(M, KN_MB), threads);
  const int64_t mb = at::divup(at::divup(M, m_blocks), KN_MR) * KN_MR;
  if (K == 0) {  // an empty sum
    if (!accumulate)
      for (int64_t m = 0; m < M; ++m) std::fill(C + m * ldc, C + m * ldc + N, 0.f);
    return;
  }
  // An A read down its columns (dY^T: each k a row of dY, as wide as the layer's output) too large to
  // stay in cache (over a megabyte) is copied a block of k at a time into tiles of KN_MR rows, k by k
  // (pack_a, as the packed form copies its A), the order the tile reads it: otherwise each k of a tile is a new cache line, and past a few hundred
  // columns a new page. The copy is read by every column tile, so it costs a fraction of one pass over A.
  const bool copy_a = sam == 1 && sak != 1 && M * K > (int64_t{1} << 18);
  at::parallel_for(0, m_blocks, 1, [&](int64_t lo, int64_t hi) {
    thread_local std::vector<float> Ap;
    if (copy_a) Ap.resize(static_cast<size_t>(mb * KN_KB));
    for (int64_t ib = lo; ib < hi; ++ib) {
      const int64_t m_lo = ib * mb, m_hi = std::min(M, m_lo + mb);
      for (int64_t k0 = 0; k0 < K; k0 += KN_KB) {  // k ascending for every output: a fixed order
        const int64_t kb = std::min(KN_KB, K - k0);
        if (copy_a) pack_a<KN_MR>(A, sak, m_lo, m_hi - m_lo, k0, kb, Ap.data());
        // every column tile against this block of A before the next block of k (it stays in cache)
        for (int64_t n0 = 0; n0 < N; n0 += TW) {
          const int64_t cols = std::min(TW, N - n0);
          const int nv = static_cast<int>((cols + W - 1) / W);
          const int64_t last = cols - (nv - 1) * W;
          for (int64_t m0 = m_lo; m0 < m_hi; m0 += KN_MR) {
            const int mr = static_cast<int>(std::min<int64_t>(KN_MR, m_hi - m0));
            const float* a = copy_a ? Ap.data() + (m0 - m_lo) * kb : A + m0 * sam + k0 * sak;
            kn_any(mr, nv, last == W, a, copy_a ? 1 : sam, copy_a ? KN_MR : sak, B + k0 * ldb + n0, ldb,
                   C + m0 * ldc + n0, ldc, kb, last, accumulate || k0 > 0);
          }
        }
      }
    }
  });
}

namespace {

void check2d(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1,
              op, ": ", name, " must be a 2-d float32 CPU tensor with contiguous rows");
}

// y = x w^T (+ b): x [M, K], w [N, K] (a Linear's weight as stored), b [N]
at::Tensor linear_fwd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  check2d(x, "linear_fwd", "x");
  check2d(w, "linear_fwd", "w");
  TORCH_CHECK(x.size(1) == w.size(1), "linear_fwd: shapes disagree: x ", x.sizes(), ", w ", w.sizes());
  if (b.has_value()) {
    TORCH_CHECK(b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == w.size(0),
                "linear_fwd: b must be a contiguous float32 [", w.size(0), "]");
  }
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  gemm_nt(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), w.stride(0),
          b.has_value() ? b->data_ptr<float>() : nullptr, y.data_ptr<float>(), y.size(1), x.size(0), w.size(0),
          x.size(1));
  return y;
}

// y = x [w_1; ...; w_n]^T (+ [b_1; ...; b_n]): the layers' outputs side by side, each written in place
// at its columns (row stride the sum of their widths) by the same product as linear_fwd's, so the
// same bits as their torch.cat without the copy. bs[i] None where layer i has no bias.
at::Tensor linears_fwd(const at::Tensor& x, at::TensorList ws, const c10::List<std::optional<at::Tensor>>& bs) {
  check2d(x, "linears_fwd", "x");
  TORCH_CHECK(!ws.empty() && bs.size() == ws.size(), "linears_fwd: ", ws.size(), " weights and ", bs.size(),
              " biases: give one bias (or None) for each weight");
  int64_t width = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    check2d(ws[i], "linears_fwd", "each w");
    TORCH_CHECK(x.size(1) == ws[i].size(1), "linears_fwd: shapes disagree: x ", x.sizes(), ", w ", i, " ", ws[i].sizes());
    const std::optional<at::Tensor> b = bs.get(i);
    TORCH_CHECK(!b.has_value() || (b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == ws[i].size(0)),
                "linears_fwd: b ", i, " must be a contiguous float32 [", ws[i].size(0), "]");
    width += ws[i].size(0);
  }
  at::Tensor y = at::empty({x.size(0), width}, x.options());
  int64_t col = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    const std::optional<at::Tensor> b = bs.get(i);
    gemm_nt(x.data_ptr<float>(), x.stride(0), ws[i].data_ptr<float>(), ws[i].stride(0),
            b.has_value() ? b->data_ptr<float>() : nullptr, y.data_ptr<float>() + col, width, x.size(0), ws[i].size(0),
            x.size(1));
    col += ws[i].size(0);
  }
  return y;
}

// dx = dy w: dy [M, N], w [N, K]
at::Tensor linear_dx(const at::Tensor& dy, const at::Tensor& w) {
  check2d(dy, "linear_dx", "dy");
  check2d(w, "linear_dx", "w");
  TORCH_CHECK(dy.size(1) == w.size(0), "linear_dx: shapes disagree: dy ", dy.sizes(), ", w ", w.sizes());
  at::Tensor dx = at::empty({dy.size(0), w.size(1)}, dy.options());
  gemm_kn(dy.data_ptr<float>(), dy.stride(0), 1, w.data_ptr<float>(), w.stride(0), dx.data_ptr<float>(), dx.size(1),
          dy.size(0), w.size(1), dy.size(1), false);
  return dx;
}

// dx = dy [w_1; ...; w_n]: dy [M, N_1 + ... + N_n] (the layers' output gradients side by side), each
// w_i [N_i, K]. Each layer's product adds into dx where the one before left it, so every element is
// one FMA chain over all of dy's columns, ascending: the bits of linear_dx on the stacked weight,
// without stacking it, and without a sum of n rounded parts (and its passes over dx).
at::Tensor linears_dx(const at::Tensor& dy, at::TensorList ws) {
  check2d(dy, "linears_dx", "dy");
  TORCH_CHECK(!ws.empty(), "linears_dx: no weights");
  int64_t width = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    check2d(ws[i], "linears_dx", "each w");
    TORCH_CHECK(ws[i].size(1) == ws[0].size(1), "linears_dx: shapes disagree: w 0 ", ws[0].sizes(), ", w ", i, " ",
                ws[i].sizes());
    width += ws[i].size(0);
  }
  TORCH_CHECK(dy.size(1) == width, "linears_dx: shapes disagree: dy ", dy.sizes(), " against weights ", width,
              " rows in all");
  at::Tensor dx = at::empty({dy.size(0), ws[0].size(1)}, dy.options());
  int64_t col = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    gemm_kn(dy.data_ptr<float>() + col, dy.stride(0), 1, ws[i].data_ptr<float>(), ws[i].stride(0), dx.data_ptr<float>(),
            dx.size(1), dy.size(0), dx.size(1), ws[i].size(0), i > 0);
    col += ws[i].size(0);
  }
  return dx;
}

// dw = dy^T x: dy [M, N], x [M, K] -> [N, K]
at::Tensor linear_dw(const at::Tensor& dy, const at::Tensor& x) {
  check2d(dy, "linear_dw", "dy");
  check2d(x, "linear_dw", "x");
  TORCH_CHECK(dy.size(0) == x.size(0), "linear_dw: shapes disagree: dy ", dy.sizes(), ", x ", x.sizes());
  at::Tensor dw = at::empty({dy.size(1), x.size(1)}, dy.options());
  gemm_kn(dy.data_ptr<float>(), 1, dy.stride(0), x.data_ptr<float>(), x.stride(0), dw.data_ptr<float>(), dw.size(1),
          dy.size(1), x.size(1), dy.size(0), false);
  return dw;
}

// Which form the products take: "auto" (`packed` above), "packed" wherever it can run, or "tiled"
// (the register-tiled loops only); "" only asks. Returns the form that was set. For the tests, which
// run both forms on any CPU, and for timing one against the other.
std::string gemm_form(std::string form) {
  static const char* names[] = {"auto", "packed", "tiled"};
  const int before = g_form.load();
  if (!form.empty()) {
    const auto it = std::find(std::begin(names), std::end(names), form);
    TORCH_CHECK(it != std::end(names), "gemm_form: ", form, " is not a form: use auto, packed or tiled");
    g_form.store(static_cast<int>(it - std::begin(names)));
  }
  return names[before];
}

}  // namespace
}  // namespace posttrain

TORCH_LIBRARY_FRAGMENT(posttrain, m) {
  m.def("linear_fwd", &posttrain::linear_fwd);
  m.def("linears_fwd", &posttrain::linears_fwd);
  m.def("linear_dx", &posttrain::linear_dx);
  m.def("linears_dx", &posttrain::linears_dx);
  m.def("linear_dw", &posttrain::linear_dw);
  m.def("gemm_form", &posttrain::gemm_form);
}
