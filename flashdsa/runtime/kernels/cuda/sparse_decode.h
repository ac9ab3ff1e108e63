// Arguments of the native sparse MLA decode (sparse_decode.cu), shared with its torch op
// (sparse_decode_op.cpp). Plain C++: no CUDA or torch header, so both sides compile anywhere.
#pragma once

#include <cstdint>

namespace flashdsa {

// One call: rows = b * s_q query rows, each with its own topk slot ids; h_q = head_blocks * 64.
struct SparseDecodeArgs {
  const void* q;          // [rows, h_q, 576] bf16, contiguous, 16-byte aligned
  const uint8_t* cache;   // [num_slots, 656] FP8 MLA tokens, 16-byte aligned
  int64_t num_slots;      // num_blocks * block_size: a slot id outside [0, num_slots) is invalid
  const int32_t* indices; // [rows, topk] int32 slot ids, contiguous
  int64_t rows;
  int s_q;                // rows per batch entry (lse is [b, h_q, s_q])
  int h_q;                // 64 or 128
  int topk;
  int splits;             // >= 1: the top-k list is cut into this many parts of tokens_per_split
  int tokens_per_split;   // a multiple of 64
  float scale_log2;       // sm_scale * log2(e)
  void* out;              // [rows, h_q, 512] bf16
  float* lse;             // [b, h_q, s_q] fp32
  float* part_out;        // splits > 1: [rows, splits, h_q, 512] fp32 workspace
  float* part_lse;        // splits > 1: [rows, splits, h_q] fp32 workspace
};

constexpr int kSparseDecodeHeadsPerCta = 64;
constexpr int kSparseDecodeKeysPerTile = 64;
constexpr int kSparseDecodeMaxSplits = 128;
constexpr int kSparseDecodeMaxTopk = 16384;

// Launches the decode (and, for splits > 1, the combine) on `stream` of `device`.
// Returns nullptr or the CUDA error's text.
const char* launch_sparse_decode(const SparseDecodeArgs& args, int device, void* stream);

}  // namespace flashdsa
