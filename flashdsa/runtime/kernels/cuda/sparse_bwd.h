// Arguments of the native sparse MLA backward's dkv half (sparse_bwd.cu), shared with its torch op
// (sparse_bwd_op.cpp). Plain C++: no CUDA or torch header, so both sides compile anywhere.
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

constexpr int kSparseBwdSlotsPerTile = 64;

// Launches the dkv kernels (one per column range of a CTA) on `stream` of `device`. Returns nullptr or
// the CUDA error's text.
const char* launch_sparse_bwd_dkv(const SparseBwdDkvArgs& args, int device, void* stream);

}  // namespace flashdsa
