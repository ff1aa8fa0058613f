"""Which quantized-matmul path runs for which shape class, the qmv kernel's blocking, and the kernel
variants that stay off until their GPU tests have passed.

Numbers come from the project's H200 (MLX 0.32.4 CUDA); each row names the record (benchmarks/*.md)
that holds its measurement. Change a row only with a measurement that justifies it. Every switch of a
kernel variant is a row here; MTLQWEN_SELECT="row=value,..." overrides rows for one process.
"""

from __future__ import annotations

import contextlib
import os

SELECT: dict[str, int] = {
    # M <= 8: our qmv kernel. At M=1 it beats MLX's qmv by 1.2-1.8x (lm_head 340 vs 603 us), at M=2/4 by
    # 1.5-2.7x (MLX's qmv re-reads the weights per row) (benchmarks/kernels_qmatmul_attn.md). At M=8 MLX
    # switches to its GEMM (qmm_sm80), which a chain of launches showed 2.4x faster (25 vs 62 us, qkv) --
    # but those chains let independent launches overlap. Timed one kernel at a time inside a real B=8 step
    # (Nsight Compute, benchmarks/decode_profile.md), qmm_sm80 takes ~58 us for every K=4096 matrix whatever
    # N (grid of only N/128 blocks: bound by the K loop) and 168 us for down_proj, so our qmv (40-103 us,
    # 512+ blocks) wins at 8 rows too.
    "qmv_max_rows": 8,
    # ... except a matrix this wide at 8 rows (the LM head, N = 248320), where MLX's GEMM took 471 us
    # against the FMA qmv's 1334 us (benchmarks/decode_profile.md); 0 = never. On CUDA the tensor-core qmv
    # serves 8 rows (qmv_mma_min_rows) and takes 358 us with 4 tiles a threadgroup against MLX's 481
    # (benchmarks/qgemm.md), so the row applies only where the FMA qmv would serve 8 rows.
    "mlx_qmm_min_n_at_8_rows": 65536,
    # More rows than that, N not a multiple of 128 (the GDN b / a projections, N = 32): MLX has no
    # tensor-core GEMM for it (qmm_naive: 77 us per 32x4096 matrix, benchmarks/decode_profile.md);
    # dequantize the small matrix and use the bf16 GEMM instead. fp32 activations too: on the H200 MLX's
    # quantized GEMM failed to launch at 33 fp32 rows, N = 96 ("cuGraphAddKernelNode: invalid argument",
    # test_kernels_qmatmul.py::test_linear_large_m_paths).
    "small_n_dequant": 1,
    # CUDA, more rows than the qmv takes, K not a multiple of 256 (the tensor-core GEMM's k-step): 1 =
    # dequantize + GEMM rather than MLX's quantized GEMM. On the H200 the MoE dispatch test failed at 9 tokens
    # (wrong, or non-finite at 4-bit g64), and the only op its failing cases ran that the passing ones did not
    # is MLX's quantized_matmul on 9+ rows with K one quantization group (128 at g128, 64 at g64;
    # benchmarks/moe.md). With this row the dispatch test passed on the H200. Real Qwen3.5 shapes have K % 256 == 0;
    # small K comes from tests and tiny models.
    "small_k_dequant": 1,
    # CUDA, 4-bit, bf16/fp16 x: rows from which the tensor-core qmv variant (mma.sync) replaces the FMA
    # kernel; 0 = never. Steady state (one launch): at M=8 mma 1.09 / 1.27 TB/s vs FMA 0.43 / 0.33 and MLX's
    # GEMM 1.11 / 1.05 (4096-K / 12288-K); at M=1 mma 1.24 / 1.36 vs FMA 1.69 / 1.94. Its equivalence test
    # passed on the H200 (benchmarks/kernels_qmatmul_attn.md); with it on, 8 concurrent requests decode at
    # 1252 tok/s against 578 without (runtime_bench, benchmarks/e2e.md). From 2 rows since the row tiles:
    # per call at 2 / 3 / 4 rows the 9B projections take 15-59 / 16-50 / 16-57 us on it against 17-61 /
    # 19-78 / 21-86 on the FMA kernel (the LM head 348 / 339 / 352 against 414 / 480 / 592); at 1 row the
    # FMA kernel wins every shape (224 against 336 for the LM head). In spec_bench's plain step, 2 sequences
    # 5.34 against 6.14 ms, 4 sequences 5.65 against 9.13 (benchmarks/kernels_qmatmul_attn.md).
    "qmv_mma_min_rows": 2,
    # The tensor-core variant is CUDA-only (Apple GPUs have no mma.sync; simdgroup_matrix is 8x8). On Metal
    # the rows qmv_mma_min_rows selects it for run: 0 = the FMA qmv kernel (the tensor-core kernel's
    # portable body: the one check_metal verifies), 1 = MLX's Metal quantized_matmul (the op's reference).
    # Neither is measured on an Apple GPU yet.
    "qmv_mma_metal": 0,
    # The tensor-core qmv's blocking (gemv.mma_config): 16-row tiles a threadgroup (each threadgroup reads
    # the x rows from L2 once for its tiles), K groups a SIMD group loads per pass (0: 256 columns' worth),
    # and whether those groups are consecutive (1) or NW groups apart (0). H200, 8 rows, per call in chains
    # (kernels_qmatmul_attn.py --only mma-sweep): 2 tiles of 2 groups against the former 1 of 4: gate+up
    # 51.2 against 63.7 us, down 32.7 / 37.5, GDN in_proj 51.9 / 53.7, o 15.0 / 17.1; the LM head's
    # 248,320 rows take 4 tiles of 1 group (qmv_mma_wide_tiles): 358 against 473 us (benchmarks/qgemm.md).
    "qmv_mma_tiles": 2,
    "qmv_mma_groups": 2,
    "qmv_mma_consecutive": 0,
    "qmv_mma_wide_tiles": 4,  # from 65536 rows: (this many tiles, 1 group a pass); 0 = the rows above
    # One qmv launch per 8 rows past that: disabled (0). At M=16 MLX's qmm took 15-41 us, qmv per 8
    # rows 71-207 us (benchmarks/kernels_qmatmul_attn.md).
    "qmv_loop_max_rows": 0,
    # From this many rows on: dequantize to the activation dtype (qmatmul/dequant.py's kernel), then MLX's bf16 GEMM
    # (cuBLAS). Device time on the H200 (CUPTI, benchmarks/qgemm.md), 12288x4096 4-bit: at 128 rows 64.8 us
    # against the tensor-core GEMM's 67.0, at 256 72.8 against 129.3, at 1024 166 (79% of the bf16 GEMM on
    # bf16 weights, 130.6) against 497; the other 9B matrices cross at the same place.
    "dequant_gemm_min_rows": 129,
    # GDN decode / prefill kernels write the new recurrent states into the pool in place (gdn/kernels.py)
    # instead of returning them for a scatter, which on the GPU copies the whole pool every step (MLX keeps
    # kernel inputs alive, so the pool is never donated): +54 MiB per step at B=1 with one slot, +423 MiB at
    # B=8 (benchmarks/decode_profile.md). Its property test and the engine's GPU test passed on the H200
    # (benchmarks/kernels_gdn.md); 0 returns to the functional scatter.
    "gdn_state_inplace": 1,
    # A batch whose longest segment exceeds this many tokens runs the GDN chunk kernel, shorter ones the
    # token-by-token recurrence (gdn/kernels.py). At one sequence on the H200 the recurrence was faster at
    # T = 16..64 and the chunk kernel ~10% at 128 (benchmarks/kernels_gdn.md); verification rows
    # (candidates) always take the recurrence.
    "gdn_chunk_min_t": 64,
    # New tokens' K/V written into the paged pools in place (attention/kv_write.py) instead of MLX's
    # functional scatter, which copies the whole pool each step while the previous step's attention still
    # holds it (on the H200: +384 MiB peak for 4 x 96 MiB of extra pool). Its GPU test (in-place write, then
    # attention, against the functional scatter) passed on the H200 (benchmarks/kernels_qmatmul_attn.md);
    # 0 = the scatter (a debugging switch: MTLQWEN_SELECT="kv_inplace=0").
    "kv_inplace": 1,
    # Attention's q/k RMSNorm + partial RoPE as one launch per tensor reading q in place from the q|gate
    # projection (rope/kernels.py): 3 launches and a copy fewer per attention layer (B=1 step: 494 -> 438
    # primitives). tests/test_kernels_small.py::test_head_norm_rope_kernel passed on the H200
    # (benchmarks/kernels_gdn.md), and the whole-model and engine GPU tests passed with it on.
    "head_norm_rope": 1,
    # The attention layer's q norm + RoPE, k norm + RoPE and the in-place KV write in one launch
    # (attention/prep.py) where all three would run their kernels: 2 launches fewer per attention layer
    # (16 per 9B step, 20 per 35B-A3B step) at ~13-20 us of host time each on the H200's hosts
    # (benchmarks/decode_profile.md). Its GPU tests passed on the H200, and the 9B, 35B-A3B and 122B-A10B
    # end-to-end runs served it (fp32 norm weights beside bf16 activations: a compile failure there until
    # the weights got their own type). Not yet timed in a running step (the one trace ran with it switched
    # off by that failure). 0 = the three launches.
    "attn_prep_fused": 1,
    # The DFlash drafter's q / k norm + RoPE and its block's (or context's) K/V write in one launch, k and v read
    # in place from the stacked k|v projection (attention/ops.py drafter_attention_prep, drafter_context_write):
    # per drafter layer, the 5 launches before the attention become 1 in a proposal (q and k norm + RoPE, MLX's
    # copies of the k and v slices, the write) and 4 become 1 in a context write. H200, 9B drafter shape, 1 x 7
    # drafts: 35 launches a step fewer, 9.67 against 10.19 ms in one process (benchmarks/spec.md). 0 = those launches.
    "drafter_prep": 1,
    # out_proj / o_proj / down_proj at decode sizes carry the residual add + next RMSNorm in their epilogue
    # (qmatmul/residual.py): 64 add_rms_norm launches fewer per 9B step (40 per 35B-A3B step). Its GPU test
    # passed on the H200. Timed in a running B=1 step (benchmarks/step_trace.py) on a host that kept up with
    # the device, it made the step's kernels 0.21 ms longer (3.55 -> 3.76 ms; 26.0 us a launch against
    # 14.5 + 4.0 for the plain qmv and add_rms_norm). On the hosts of the later leases the step is host-bound
    # (5.65 ms of host time for 283 primitives, ~20 us each; an add_rms_norm launch alone 13.5 us to encode:
    # benchmarks/decode_profile.md). The A/B on such a host (9B, B=1, step_trace.py --variants
    # qmv_residual_norm=0): period 4,516 us on against 4,570 off; the host's encode time fell 1.35 ms
    # (224 launches against 288) and it now waits 0.93 ms on the device, whose busy time rose 0.54 ms
    # (3,720 against 3,180 us). On: slightly faster where the host bounds, and the epilogue's device cost
    # (~8 us a launch over the plain qmv + add_rms_norm) is what to cut next.
    "qmv_residual_norm": 1,
    # The same epilogue on the tensor-core qmv's rows (qmv_mma_min_rows..8: 2-8 decoders, a verification
    # of up to 8 rows), residual.qmv_mma_add_rms: 64 add_rms_norm launches fewer in such a 9B step, but on
    # the H200 44.0 us a launch against 21.7 + 4.3 apart (the last threadgroup normalises 8 rows in turn):
    # +1.4 ms of device time a step at 8 sequences (benchmarks/kernels_qmatmul_attn.md). Off.
    "qmv_mma_residual_norm": 0,
    # Decode rows (one token a sequence) of a GDN layer: the input projections' qmv does the causal conv +
    # SiLU and the conv-state write in its epilogue (qmatmul/conv_epilogue.py), one launch a GDN layer
    # fewer (24 a 9B step). Its GPU tests pass on the H200, the model's decode logits bit for bit those of the
    # two launches; same process A/B (suite.py e2e@): 9B batch-1 decode 228.7 -> 274.0 tok/s, batch 8 1,579
    # -> 1,594; 35B-A3B 200.9 -> 206.0 and 1,136 -> 1,188 (benchmarks/decode_profile.md).
    "qmv_conv_epilogue": 1,
    # The residual epilogue's columns a thread takes per pass (qmatmul/residual.py): 0 = all of them in one
    # pass, held in registers; 8 = two passes of 8 at a time, which keeps the whole kernel at 55 registers
    # at M=1 (107 with one pass, the plain qmv 64: ptxas -v, sm_90), so the GEMV keeps its resident SIMD
    # groups, for a longer tail in the last threadgroup. H200, 9B batch-1 decode step (step_trace.py
    # --variants qmv_residual_chunk=8, benchmarks/decode_profile.md): device busy 3,531 against 3,689 us
    # with one pass, the same 208 launches.
    "qmv_residual_chunk": 8,
    # The FMA qmv loads the next chunks' weights before the current chunks' math (template PF). Written to
    # keep loads in flight at M=1, where the kernel stalled at ~1.9-2.0 TB/s steady state (lm_head 291 us
    # for 572 MB, benchmarks/decode_profile.md). Its test passed on the H200, but summed over a 9B step's
    # shapes at the table's blocking it lost (4.39 vs 4.37 ms, benchmarks/kernels_qmatmul_attn.md): off.
    "qmv_prefetch": 0,
    # 4-bit FMA qmv: weight nibbles unpacked in pairs (one shift per two weights; qmatmul/bodies.py, template
    # NP): ~3.2 instead of ~3.6 instructions per weight at M=1 (PTX count). Its GPU tests passed on the H200;
    # in a running B=1 step (step_trace.py) gate+up went from 30.2 to 28.0 us and the step's kernels from
    # 3.98 to 3.88 ms (benchmarks/decode_profile.md).
    "qmv_nibble_pairs": 1,
    # FMA qmv blocking at M=1: R weight rows per SIMD group, U 16-byte chunks in flight per lane and row (the
    # second value for N <= 4096). Chains of launches had picked R=4 with U=2 / U=4 (QMV_BLOCKING below),
    # but timed in a running B=1 step (step_trace.py) U=1 was faster for every shape: gate+up 28.1 -> 26.0
    # us, GDN in_proj 18.5 -> 16.2, o/out/down_proj 17.0 -> 16.0 on average: at 64 registers (U=4: 128) an
    # SM holds 32 SIMD groups instead of 12, and one group's math overlaps another's loads. R=8 took
    # o/out/down_proj from 15.8 to 18.4 us (96 registers: 20 SIMD groups an SM); the SwiGLU qmv (R gate + R
    # up rows) went from 26.1 to 24.6 us with R=2 instead of 4 (benchmarks/decode_profile.md).
    "qmv_m1_rows": 4,
    "qmv_m1_swiglu_rows": 2,  # gate rows (as many up rows) per SIMD group of the SwiGLU qmv at M=1
    "qmv_m1_chunks": 1,
    "qmv_m1_chunks_small_n": 1,
    # Decode attention splits the context into ranges of at least this many keys (attention/kernels.plan):
    # below it a split's fixed cost (q load, merge traffic) outweighs its parallelism. Chains of 40 calls
    # could not tell 32-256 apart; timed in a running B=1 step with 512 cached keys (step_trace.py, after
    # the V loads were hoisted): split + merge 28.5 + 4.0 us at 256 (3 splits), 15.6 + 4.4 at 64, 13.1 +
    # 5.8 at 32 (benchmarks/decode_profile.md). 64: nearly the best there, and half the merge traffic of 32
    # on long contexts.
    "attn_min_split_keys": 64,
    # Attention batches whose longest query chunk has more than this many queries take the tensor-core prefill
    # kernel (attention/prefill.py, CUDA: FlashAttention-2 over the paged blocks with mma.sync); up to it,
    # decode rows take the decode kernel above, which re-reads every key per 16 query rows in fp32 FMAs; 0 =
    # never (the decode kernel for every batch). Its equivalence tests passed on the H200
    # (benchmarks/results/gpu-tests-prefill-attention-moe.log). Crossover timed on the H200
    # (prefill_attention_bench.py --crossover, 8 sequences, 9B attention shape): the prefill kernel wins from
    # the smallest count timed, 4 queries a sequence (90 vs 188 us at 4k cached keys, 610 vs 1,429 us at
    # 32k; 613 vs 4,744 us at 16 queries and 32k); 2-3 were not timed, so 3. The equivalence test draws
    # chunks of 4-16 queries too and passed on the H200 with them (benchmarks/prefill_attention.md).
    # Uncompiled verification batches (n_draft + 1 rows a sequence) take it as well; traced (compiled)
    # layouts keep the decode kernel: the prefill kernel's plan reads kv_valid on the host. On Metal
    # there is no tensor-core rendering (Apple GPUs have no mma.sync; the emulator has no simdgroup_matrix):
    # the decode kernel's portable SIMT body serves prefill chunks too (a plain SIMT tiling could not share a
    # K/V tile among more rows: at head_dim 256 its 16 fp32 query rows already take half of Metal's 32 KiB of
    # threadgroup memory), and check_metal runs it on a prefill-sized batch (metal_cases.py). MLX's own
    # attention over gathered K/V is not used: it would copy each sequence's context out of the pool every
    # layer.
    "prefill_attn_min_queries": 3,
    # An eager forward of at least `prefill_eval_min_rows` rows (a prefill step) launches its layers in groups
    # of `prefill_eval_layers` (mx.async_eval) while the host still builds the rest; 0 = one evaluation at the
    # end. H200 (step_trace.py --prefill, benchmarks/prefix_cache.md): a 512-row 9B chunk 42.1 -> 35.9 ms wall
    # (0 / 8 layers; 2: 36.8, 4: 38.9), a warm prefix hit's step (8 x 64 over 2048) 37.2 -> 30.4, a 1024-row
    # 35B-A3B chunk 87.3 -> 67.0 / 68.0 (groups of 4 / 10; 8 not traced there, its prefill e2e ran with 8):
    # the host built all ~800-2,500 launches before the first ran.
    "prefill_eval_layers": 8,
    "prefill_eval_min_rows": 256,
    # The first evaluation after this many layers as well (0 = none): until the host's first async_eval the
    # device is idle, 5.4 ms of a 9B warm prefix hit's step with groups of 8 (step_trace.py). With 1, the warm
    # prefix TTFT was 36.1 / 679.1 ms = 5.32% of the cache-off run, against 5.38% and 5.48% for the defaults in
    # two processes of other leases (benchmarks/prefix_cache.md): no difference above the spread: off.
    "prefill_eval_first": 0,
    # 1 = the last group of layers halved down to one layer (8, 8, 8, 4, 2, 1, 1 of 32): a step ends when the
    # device has run the group the host built last, and with the host the slower of the two that group is
    # all that remains after the last launch. H200, 9B warm prefix TTFT in one process: 43.7 ms against 41.3
    # with it off (benchmarks/prefix_cache.md): off.
    "prefill_eval_tail": 0,
    # Warps a prefill-attention block (16 query rows each, attention/prefill.py): 8 = 128 query rows per 64-key
    # tile, FlashAttention-2's choice at head_dim 256 (128 KiB of shared memory and 248 registers a lane: one
    # block an SM); 4 = 64 rows, two blocks an SM, but each K/V tile copied from L2 serves half the rows.
    # H200, 32k causal prompt at the 9B shape (prefill_attention_bench.py --nw 4 8): 8 warps 40.0 ms a layer
    # (220 TFLOP/s), 4 warps 42.0 ms (209) in 4096-query chunks; 40.4 / 43.0 ms in 1024-query chunks.
    "prefill_attn_warps": 8,
    # A prefill-attention batch of too few query tiles to fill the SMs (a short chunk over a long context) splits
    # its key range, each split at least this many keys, and the decode kernel's merge combines them
    # (attention/prefill.plan); 0 = never split. Not yet measured.
    "prefill_attn_split_keys": 512,
    # The conv kernel writes each sequence's new conv state (its last K-1 raw rows) into the conv pool in
    # place instead of returning it for a scatter (conv/kernels.py): one built-in launch fewer per GDN
    # layer. tests/test_kernels_small.py::test_conv_inplace_kernel passed on the H200 (benchmarks/kernels_gdn.md).
    "conv_state_inplace": 1,
    # The GDN recurrence with the gated RMSNorm of its output in the same launch (gdn/normed.py): one
    # custom-kernel launch fewer per GDN layer at decode. tests/test_kernels_gdn.py::test_gdn_fused_norm_kernel
    # passed on the H200 (benchmarks/kernels_gdn.md).
    "gdn_fused_norm": 1,
    # The same fusion for a verification's GDN layer, which also stores the state after every token
    # (gdn/normed.py NORMED_CAND): 24 launches fewer in a 9B speculative step of the candidates commit. Its
    # GPU test (test_kernels_gdn.py::test_gdn_fused_norm_kernel, mode "candidates") passed on the H200, but at
    # 1 x 7 drafts the fused launches took 0.78 ms against 0.54 + 0.17 for the two (spec_trace.py,
    # benchmarks/spec.md): off.
    "gdn_fused_norm_candidates": 0,
    # Tokens the fused recurrence (gdn/normed.py) reads into threadgroup memory a block where segments are 2+
    # tokens (prefill up to gdn_chunk_min_t, verification), 0 = none: the unstaged body waits on each token's
    # device reads in turn, which is what a step of the 9B warm prefix hit (8 x 64 tokens) spends 299 us a layer
    # on (benchmarks/kernels_gdn.md). Off until its GPU test (test_kernels_gdn.py::test_gdn_fused_norm_kernel,
    # `stage`) has passed on the H200 and it is timed; its Metal rendering passes on the emulator.
    "gdn_normed_stage": 0,
    # The same for the unfused recurrence (gdn/staged.py: a verification's candidates, prefill segments the chunk
    # scan does not take), which reads each token's k, q, gates and v from device memory as it runs: ~0.54 us a
    # token whatever the arithmetic (4,096 tokens in 2.2 ms a layer, benchmarks/kernels_gdn.md). Off until its GPU
    # test (test_kernels_gdn_staged.py) has passed on the H200 and it is timed; its Metal rendering passes on the
    # emulator.
    "gdn_recurrent_stage": 0,
    # Longest segment the fused recurrence + norm takes, besides gdn_chunk_min_t (0: no bound of its own). With
    # gdn_chunk_min_t raised, segments between the two go to the unfused recurrence (staged with the row above)
    # and the separate norm: the fused kernel's one threadgroup a head is too few for one long prompt.
    "gdn_normed_max_t": 0,
    # CUDA, 9+ rows, 4/8-bit, bf16/fp16 x: the tensor-core quantized GEMM (qmatmul/qgemm.py) up to this many rows
    # (0 = never); past it, and on Metal, the paths above (MLX's quantized_matmul / dequantize + GEMM). At
    # 16-128 rows it beat MLX's quantized_matmul on every 9B matrix (in_proj at 16 rows: 19-24 vs 26 us, at
    # 128: 67 vs 105; benchmarks/qgemm.md); 16 / 32 concurrent requests decode at 2,448 / 3,386 tok/s
    # with it against 1,142 / 1,462 without (runtime_bench).
    "qgemm_max_rows": 128,
    # The dequantize + GEMM path dequantizes with our kernel (qmatmul/dequant.py) instead of mx.dequantize, which
    # took ~100 us per 12288x4096 4-bit matrix (benchmarks/qgemm.md).
    "dequant_kernel": 1,
    # Several projections of one input on that path (a GDN layer's four, attention's q/k/v, gate+up) dequantize
    # in one launch into one stacked matrix; gate+up then run as one GEMM [M, 2I] and one fused SwiGLU
    # (qmatmul/gemv.py). H200, the 9B warm prefix hit's step (8 x 64 rows over 2,048): 568 kernels against 784,
    # 31.3 against 35.2 ms (step_trace.py); warm TTFT 35.7 against 45.6 ms in one process (benchmarks/
    # prefix_cache.md). Its GPU tests passed on the H200. 0 = one dequantize + GEMM a projection.
    "dequant_stack": 1,
    # The stacked projections (a GDN layer's four, attention's q / k / v) as one GEMM [M, sum N] whose column
    # ranges are the outputs, where each of their GEMMs is a cuBLAS call: MLX builds its descriptors and asks
    # for an algorithm at every call, ~24 us of host time (benchmarks/decode_profile.md), 88 calls fewer a 9B
    # prefill step; the readers copy the ranges they need contiguous (~5 us each). On the H200 the warm step
    # traced alone (device-bound) took 22.9 ms with it against 22.8; the engine's warm step is host-bound and
    # has not been timed with it (benchmarks/prefix_cache.md). 0 = a GEMM a projection on its rows of the stack.
    "dequant_stack_one_gemm": 0,
    # qgemm: 16-row weight tiles per warp (1 or 2; SwiGLU always pairs 2): 2 was faster at 35 of the 42
    # (matrix, rows) points of the 9B sweep (benchmarks/qgemm.md); how many waves of blocks over the SMs
    # split-K aims for when N / tile * M / tile blocks are too few.
    "qgemm_rt": 2,
    "qgemm_split_waves": 2,
    # On Hopper (CUDA, compute capability 9), qgemm's 4-bit projections from this many rows on the warpgroup MMA
    # (qmatmul/wgmma.py; 0 = never): the tensor cores read the activation tile from shared memory, so no warp
    # builds B fragments. H200 device time at 64 rows (qgemm_bench.py --wgmma): in_proj 32.3 against 37.4 us,
    # o/out 13.2 against 16.3, gate+up 64.1 against 69.7, down 33.0 against 36.2; at 128 rows 5-12% less; at
    # 16 and 32 rows it lost (in_proj 19.4 against 18.4-19.2 at its best configuration), so mma.sync keeps
    # them. Its GPU tests passed on the H200 (benchmarks/qgemm.md).
    "qgemm_wgmma_min_rows": 33,
    # Past qgemm_max_rows and up to this many rows (0 = never), the projections of at most 128 outputs among
    # several of one input (a GDN layer's b and a) run as one qgemm launch, the others on their own path:
    # cuBLAS runs each of them as a split-K GEMM and its reduce, 96 launches of the 9B warm prefix step's 568
    # (benchmarks/prefix_cache.md). qgemm is tested to 1,100 rows. Off until the dispatch's GPU test
    # (test_kernels_qgemm.py::test_small_n_projections_past_qgemm_rows) passes and the warm step is timed.
    "qgemm_small_n_rows": 0,
    # qgemm's split-K partials reduced by one launch a call (qmatmul/splitk.py) instead of a sum and a cast
    # per output (~365 graph nodes at 16 verify rows of the 9B). A verification's "candidates" commit in one
    # in-place launch a GDN layer (gdn/commit.py) instead of eight MLX ops (192 nodes). Their GPU tests
    # (test_kernels_splitk.py, test_kernels_gdn_commit.py) passed on the H200; with both a 9B speculative
    # step at 1 x 15 drafts took 13.15 ms against 15.03 (1,129 graph nodes against 1,642), at 8 x 15 30.77
    # against 31.77 (spec_trace.py --variants, benchmarks/spec.md).
    "qgemm_reduce_kernel": 1,
    "gdn_commit_kernel": 1,
    # MoE (moe/): the same portable kernels on Metal and CUDA (Metal: run on the emulator only, check_metal).
    # Routing's softmax + top-k + renormalisation in one launch (moe/kernels.py route) instead of
    # softmax, argpartition, take, sum, divide. Its test (tests/test_kernels_moe.py) passed on the H200.
    "moe_route_kernel": 1,
    # At decode sizes (1-8 tokens) that routing runs in the router projection's launch (moe/router.py: the
    # qmv's last threadgroup routes every token), one launch a layer fewer: 40 per 35B-A3B step, at
    # ~13-20 us of host time each on the H200's hosts (benchmarks/decode_profile.md). Its GPU tests passed
    # on the H200. With the residual epilogue (attention prep switched off) a 35B-A3B B=1 step ran 318
    # kernels in 5,355 us against 438 in 5,567 with all three off (step_trace.py). 0 = apart.
    "moe_route_in_router": 1,
    # Tokens up to which the fused expert kernels serve (gate+up+SwiGLU per (token, slot), then down with
    # the routing weights and the shared expert summed in its K loop): each (token, expert) pair reads its
    # expert's rows once, so past a few tokens, where pairs start to share experts, grouped GEMMs read less.
    # 8 = the decode batch the issue targets; not yet measured (benchmarks/moe_bench.py times it).
    "moe_fused_max_tokens": 8,
    # (token, expert) pairs from which the pairs are grouped by expert on the device (sorted ids, gather_qmm
    # with sorted_indices, unsorted after): mlx-lm's SwitchGLU threshold (64 indices). Between the two rows
    # MLX's unsorted gather_qmm (the reference) serves. On the H200 sorting gained nothing (one 35B-A3B block:
    # 11,524 us sorted vs 11,325 unsorted at 1024 tokens; moe_bench.py); CUDA takes the grouped GEMM below.
    "moe_sort_min_pairs": 64,
    # CUDA: (token, expert) pairs from which the expert MLPs run on the grouped tensor-core GEMM
    # (moe/grouped.py: qgemm over each expert's padded segment, two launches) instead of sorted gather_qmm,
    # where it covers the shapes (4/8-bit, bf16/fp16, H and Im multiples of 256); 0 = never. Its tests
    # passed on the H200 (tests/test_moe_grouped.py). One 35B-A3B MoE block (moe_bench.py, H200), grouped
    # against sorted gather_qmm: 819 vs 1,821 us at 128 tokens (1,024 pairs), 823 vs 3,254 at 256, 1,033 vs
    # 6,194 at 512, 1,263 vs 11,524 at 1024, 2,696 vs 43,648 at 4096. Below 1,024 pairs it is not measured,
    # so the sorted path keeps them. End to end (e2e_bench.py, 35B-A3B, 4096-token prompt): 6,579 tok/s at
    # 128-token steps (1,896 from 8,192 pairs), 8,209 at 1024-token steps (benchmarks/moe.md).
    "moe_grouped_min_pairs": 1024,
    # Prefill paths (grouped and sorted): each token's k expert rows read back, weighted and summed (and
    # the shared expert's weighted row added) in one launch (moe/combine.py) instead of a row gather, a
    # multiply, a reduction, a multiply and an add (the gather alone 108 us a 1024-token 35B-A3B step on the
    # H200, benchmarks/moe.md). Its GPU test passed on the H200 (results/gpu-tests-moe-combine.log); the
    # prefill with it against without is not yet timed. 0 = the MLX ops.
    "moe_combine_kernel": 1,
    # Activation rows MB of one grouped tile (16, 32 or 64; 0 = by the mean pairs per expert T*k/E: the
    # smallest of them that holds it). Each tile reads its expert's whole [N, K] slab and each expert's
    # segment pads up to a multiple of MB, so MB near the mean reads an expert about once or twice and pads
    # at most MB-1 rows of it: 32 at a 1024-token step of the 35B-A3B (8192 pairs over 256 experts), 64
    # at 4096. One block at 128 / 256 / 512 tokens (moe_bench.py --tile-rows): MB 16 took 803 / 805 / 974
    # us, 32 871 / 923 / 1,134, 64 1,077 / 1,110 / 1,331, and the rule (16 at all three) 819 / 823 / 1,033:
    # the rule's pick within the runs' noise. 1024 tokens and up not yet swept.
    "moe_grouped_tile_rows": 0,
    # Fused expert kernels' rows per SIMD group: gate rows (as many up rows) of gate+up, rows of down. The
    # qmv's M=1 SwiGLU row count (qmv_m1_swiglu_rows); down at 2 so H = 2048 gives 256 threadgroups at
    # batch 1 (4 rows: 128, under one per SM of the H200). Not yet swept (moe_bench.py --rows).
    "moe_gate_up_rows": 2,
    "moe_down_rows": 2,
}


def parse_rows(spec: str, table: dict[str, int] | None = None, source: str = "MTLQWEN_SELECT") -> dict[str, int]:
    """"ROW=INT,ROW=INT" -> {row: value}; an unknown row or a non-integer value is an error, so a typo never
    silently measures the default (MTLQWEN_SELECT, benchmarks' --variants)."""
    table = SELECT if table is None else table
    rows = {}
    for item in filter(None, (t.strip() for t in spec.split(","))):
        name, sep, value = (t.strip() for t in item.partition("="))
        if not sep or name not in table or not value.lstrip("-").isdigit():
            raise ValueError(f"{source}: {item!r} is not NAME=INT with NAME one of {sorted(table)}")
        rows[name] = int(value)
    return rows


def _apply_env_overrides(table: dict[str, int], spec: str) -> None:
    """`MTLQWEN_SELECT="gdn_state_inplace=1,qmv_mma_min_rows=5"`: try a row on the device without an edit."""
    table.update(parse_rows(spec, table))


@contextlib.contextmanager
def selected(rows: dict[str, int]):
    """SELECT with `rows` changed inside the block, restored after (kernel choices read SELECT when an op
    is built or a step traced): benchmarks time variants of one step in one process."""
    unknown = set(rows) - set(SELECT)
    if unknown:
        raise ValueError(f"unknown selection rows {sorted(unknown)}")
    saved = {k: SELECT[k] for k in rows}
    SELECT.update(rows)
    try:
        yield
    finally:
        SELECT.update(saved)


_apply_env_overrides(SELECT, os.environ.get("MTLQWEN_SELECT", ""))

# (MT, bits) -> (R weight rows per SIMD group, U chunks in flight per lane and row). R amortises each
# activation load over R rows; U keeps loads in flight. Swept at M=1 / 8 on 4096x4096, 12288x4096 and
# 4096x12288 (4-bit): M=1 best R=4 (U=4 for N <= 4096: 13.4 us; U=2 for larger N: 25 us vs 28-30),
# M=8 best R=4..8, U=1. MT=2/4 and 8-bit: not swept, R=4 U=1-2 by the same reasoning. With R=4 the
# M=1 steady state rose from 1.44 / 1.58 to 1.69 / 1.94 TB/s (stacked 4096-K / 12288-K). M=1 reads the
# SELECT rows qmv_m1_* instead. The sweep: benchmarks/kernels_qmatmul_attn.md (benchmarks/qmv_pick.py).
QMV_BLOCKING: dict[tuple[int, int], tuple[int, int]] = {
    (2, 4): (4, 2),
    (2, 8): (4, 2),
    (4, 4): (4, 1),
    (4, 8): (4, 1),
    (8, 4): (4, 1),
    (8, 8): (4, 1),
}


def qmv_config(mt: int, K: int, bits: int, swiglu: bool = False, N: int = 0) -> tuple[int, int]:
    """(R, U) for a qmv launch; SwiGLU doubles R (gate + up rows), so it starts from half at MT >= 2
    to keep the accumulators in registers. M=1 reads the table's qmv_m1_* rows."""
    if mt == 1:
        R = SELECT["qmv_m1_swiglu_rows"] if swiglu else SELECT["qmv_m1_rows"]
        U = SELECT["qmv_m1_chunks_small_n"] if 0 < N <= 4096 else SELECT["qmv_m1_chunks"]
    else:
        R, U = QMV_BLOCKING[(mt, bits)]
    if swiglu and mt >= 2:
        R = max(1, R // 2)
    return R, U
