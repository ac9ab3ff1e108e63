// Arguments of the native FP4 expert GEMMs (fp4_moe.cu), shared with their torch ops
// (fp4_moe_op.cpp). Plain C++: no CUDA or torch header, so both sides compile anywhere.
#pragma once

#include <cstdint>

namespace flashdsa {

// One grouped GEMM over the 16-row blocks of aligned pairs (see fp4_moe.cu for the contract).
struct Fp4MoeArgs {
  const uint8_t* a;           // e4m3 activations [rows, K]: tokens (gate_up) or block rows (down)
  const float* a_scale;       // [rows, K / group]: group 128 (gate_up) or 32 (down)
  int64_t stride_a, stride_a_scale;
  const uint8_t* w;           // packed e2m1 [E, N, K/2]
  const uint8_t* w_scale;     // UE8M0 [E, N, K/32]
  int64_t stride_w_expert, stride_w_row, stride_s_expert, stride_s_row;
  const int* sorted_pairs;    // [blocks * 16]
  const int* block_experts;   // [blocks]
  int blocks, n, k, inter, top_k;  // n: output columns (gate_up: I; down: H)
  float limit;                // SwiGLU clip (gate_up), <= 0: none
  uint8_t* h;                 // gate_up: e4m3 [blocks * 16, I]
  float* h_scale;             // gate_up: [blocks * 16, I / 32]
  int64_t stride_h, stride_h_scale;
  void* out;                  // down: bf16 [pairs, H]
  int64_t stride_out;
  const float* route_weights;  // down: [pairs]
};

constexpr int kFp4MoeBlockM = 16;           // block rows of one expert
constexpr int kFp4MoeChunk = 128;           // inputs per step: K must be a multiple
constexpr int kFp4MoeGateUpColumns = 32;    // intermediate columns per CTA: I must be a multiple
constexpr int kFp4MoeDownColumns = 64;      // hidden columns per CTA: H must be a multiple

// gate_up (gated, SwiGLU epilogue writing h) or down (weighted rows into out); nullptr or an error.
const char* launch_fp4_moe(const Fp4MoeArgs& args, bool gated, void* stream);

}  // namespace flashdsa
