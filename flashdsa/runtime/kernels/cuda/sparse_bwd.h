// Arguments of the native sparse MLA backward (sparse_bwd_dq.cu, sparse_bwd_dkv.cu), shared with its
// torch ops (sparse_bwd_op.cpp). Plain C++: no CUDA or torch header, so both sides compile anywhere.
#pragma once

#include <cstdint>

namespace flashdsa {

// One chunk of query tokens [token0, token0 + tokens): dkv rows += dS^T q (every column) + P^T dout
// (the value columns), from the P and dS the dq kernel left in scratch for the chunk.
struct SparseBwdDkvArgs {
  const void* q;           // [s_q, h_q, d_qk] bf16, contiguous, 16-byte aligned
  const void* dout;        // [s_q, h_q, 512] bf16, contiguous, 16-byte aligned
  const void* p;           // [tokens, h_q, topk] bf16 scratch of the chunk (16-byte aligned)
  const void* ds;          // the same for dS = P (dP - delta) sm_scale
  const int32_t* indices;  // [s_q, topk] int32 key rows, contiguous; outside [0, s_kv): no contribution
  float* dkv;              // atomic: [s_kv, d_qk] fp32, added to; deterministic: [tokens * topk, d_qk]
                           // fp32 rows, one per (token of the chunk, slot), stored
  int64_t s_kv;
  int64_t token0, tokens;
  int h_q;                 // 64 or 128
  int d_qk;                // 512 or 576
  int topk;                // a multiple of 64
  bool deterministic;
};

// One chunk of query tokens [token0, token0 + tokens): dq, and the P and dS the dkv step reads, with
// P = exp(sm_scale q.k - lse) over the valid slots (0 elsewhere), dP = dout . v and
// dS = P (dP - delta) sm_scale, delta = rowsum(out * dout).
struct SparseBwdDqArgs {
  const void* q;           // [s_q, h_q, d_qk] bf16, contiguous, 16-byte aligned
  const void* kv;          // [s_kv, d_qk] bf16 key rows (the first 512 columns are the value), 16-byte aligned
  const void* out;         // [s_q, h_q, 512] bf16, contiguous, 16-byte aligned
  const void* dout;        // [s_q, h_q, 512] bf16, contiguous, 16-byte aligned
  const float* lse;        // [s_q, h_q] natural log; +inf for a row without a valid slot
  const int32_t* indices;  // [s_q, topk] int32 key rows, contiguous, 16-byte aligned (read in pairs)
  void* dq;                // [s_q, h_q, d_qk] bf16, written; 16-byte aligned
  void* p;                 // [tokens, h_q, topk] bf16 scratch of the chunk, written
  void* ds;                // the same for dS
  int64_t s_kv;
  int64_t token0, tokens;
  int h_q;                 // 64 or 128
  int d_qk;                // 512 or 576
  int topk;                // a multiple of kSparseBwdDqKeysPerTile
  float sm_scale;
};

constexpr int kSparseBwdSlotsPerTile = 64;   // dkv: key slots a tile
constexpr int kSparseBwdDqKeysPerTile = 32;  // dq: keys a tile

// The shapes both kernels take: h_q 64 or 128, d_qk 512 or 576, topk whole tiles, at most 2^31 - 1
// CTAs along a grid's x.
inline bool sparse_bwd_serves(int h_q, int d_qk, int topk, int tile, int64_t ctas) {
  return (h_q == 64 || h_q == 128) && (d_qk == 512 || d_qk == 576) && topk >= tile && topk % tile == 0 &&
         ctas <= 0x7fffffff;
}

// Launches the dq kernel on `stream` of `device`. Returns nullptr or the CUDA error's text.
const char* launch_sparse_bwd_dq(const SparseBwdDqArgs& args, int device, void* stream);

// Launches the dkv kernels (one per column range of a CTA) on `stream` of `device`. Returns nullptr or
// the CUDA error's text.
const char* launch_sparse_bwd_dkv(const SparseBwdDkvArgs& args, int device, void* stream);

}  // namespace flashdsa
