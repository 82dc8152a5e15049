"""The planted bugs: each replaces source text of the package (found wherever it lives) and names the CPU tests that
must catch it. Realistic slips, one per entry, across the reference, the host glue of the kernels, the collectives,
the layers, the overlap schedules, the Megatron adapters and checkpointing.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    area: str
    description: str
    edits: tuple  # (old source text, new source text) pairs; each old text occurs exactly once in the package
    tests: tuple  # pytest node ids or files (relative to the repository root) that must fail


REFERENCE_BYTES = ("tests/test_reference_oracle.py", "tests/test_reference_golden.py")
LAYERS = ("tests/test_layer_oracle.py",)
TOPOLOGY_LAYERS = ("tests/test_topology_layers.py::test_layers_match_the_oracle_of_their_own_group",
                   "tests/test_topology_megatron.py")
TOPOLOGY_CHECKS = ("tests/test_topology_layers.py::test_group_checks_stay_within_the_group",)
TOPOLOGY_TRAIN = ("tests/test_topology_train.py",)
CONSISTENCY = ("tests/test_parallel_consistency.py",)
TIMEOUTS = ("tests/test_parallel_timeouts.py",)
DEQUANTIZE = ("tests/test_reference_dequantize.py",)

MUTATIONS = (
    # ------------------------------------------------------------------------------------------------ reference
    Mutation("nibble_order", "reference", "element 2i packed in the high nibble (pack and unpack agree)",
             (("return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)",
               "return (codes[..., 1::2] | (codes[..., 0::2] << 4)).to(torch.uint8)"),
              ("low, high = packed & 0xF, packed >> 4", "high, low = packed & 0xF, packed >> 4")),
             REFERENCE_BYTES),
    Mutation("global_scale_python_division", "reference", "S_enc as 2688.0 / A (reciprocal times 2688 in torch)",
             (("s_enc = torch.div(numerator, amax.to(torch.float32)).clamp(max=FLT_MAX)",
               "s_enc = (FP4_MAX * e4m3_bound / amax.to(torch.float32)).clamp(max=FLT_MAX)"),),
             ("tests/test_reference_oracle.py",)),
    Mutation("rht_sign_vector", "reference", "the last sign of the RHT's sign vector flipped",
             (("RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)",
               "RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, 1)"),),
             REFERENCE_BYTES),
    Mutation("sr_columnwise_uses_rowwise_stream", "reference", "the columnwise copy draws the rowwise SR stream",
             (("ROWWISE_STREAM, COLUMNWISE_STREAM = 0, 1", "ROWWISE_STREAM, COLUMNWISE_STREAM = 0, 0"),),
             ("tests/test_reference_oracle.py", *LAYERS)),
    Mutation("sr_rule_less_or_equal", "reference", "SR rounds up when bits <= p * 65536 instead of <",
             (("torch.where(bits < probability_up * 65536.0", "torch.where(bits <= probability_up * 65536.0"),),
             ("tests/test_reference_oracle.py",)),
    Mutation("sr_philox_rounds", "reference", "SR bits from Philox4x32-10 (curand's round count) instead of 7",
             (("SR_ROUNDS = 7 ", "SR_ROUNDS = 10 "),),
             ("tests/test_reference_oracle.py",)),
    Mutation("sr_counter_layout", "reference", "SR counter words 0 and 1 swapped (row, column group)",
             (("words = philox4x32((groups, rows, torch.full_like(rows, stream), torch.zeros_like(rows))",
               "words = philox4x32((rows, groups, torch.full_like(rows, stream), torch.zeros_like(rows))"),),
             ("tests/test_reference_oracle.py",)),
    Mutation("row_scaled_dequantize_first_row_amax", "reference", "row-scaled dequantize uses row 0's amax for all",
             (("s_dec = decode_scale(amax, e4m3_bound).reshape(-1, 1, 1)",
               "s_dec = decode_scale(amax[:1], e4m3_bound).reshape(-1, 1, 1)"),),
             ("tests/test_reference_oracle.py", *LAYERS)),
    Mutation("e4m3_rounding_through_bf16", "reference", "block scale rounded to BF16 before E4M3 (double rounding)",
             (("(block_amax * factor).clamp(max=FLT_MAX).clamp(-E4M3_MAX, E4M3_MAX).to(SCALE_DTYPE)",
               "(block_amax * factor).clamp(max=FLT_MAX).clamp(-E4M3_MAX, E4M3_MAX).to(torch.bfloat16).to(SCALE_DTYPE)"),),
             REFERENCE_BYTES),
    Mutation("block_amax_15_elements", "reference", "a block's amax taken over its first 15 elements",
             (("block_amax = blocks.abs().amax(dim=2)                     # [M, K/16]",
               "block_amax = blocks[..., :15].abs().amax(dim=2)"),),
             REFERENCE_BYTES),
    Mutation("block_scale_old_operation_order", "reference", "s_b from a_b / 6 * S_enc (an older TE order)",
             (("return (block_amax * factor).clamp(max=FLT_MAX)", "return (block_amax / 6.0 * s_enc).clamp(max=FLT_MAX)"),),
             REFERENCE_BYTES),
    Mutation("block_scale_one_binade_large", "reference", "every block scale one binade too large (2 x s_b)",
             (("factor = s_enc * _ONE_SIXTH.to(s_enc.device)", "factor = s_enc * _ONE_SIXTH.to(s_enc.device) * 2"),),
             REFERENCE_BYTES),
    Mutation("e2m1_tie_away_from_zero", "reference", "0.25 rounds up to 0.5 (ties away instead of to even)",
             (("mag = torch.where(a > 0.25, 1, mag)", "mag = torch.where(a >= 0.25, 1, mag)"),),
             REFERENCE_BYTES),
    Mutation("columnwise_amax_before_rht", "reference", "the columnwise amax taken before the RHT",
             (("source = columnwise_source(x2d, rht, rht_random_sign) if rht or row_scaled else x2d",
               "source = x2d.t() if row_scaled else x2d"),),
             REFERENCE_BYTES),
    Mutation("weight_2d_tiles_as_1d", "reference", "16x16 weight tiles scaled per 1x16 row block",
             (("block_amax = tile_amax.repeat_interleave(BLOCK_SIZE, dim=0)", "block_amax = blocks.abs().amax(dim=2)"),),
             REFERENCE_BYTES),
    Mutation("fourover6_ties_pick_map_to_4", "reference", "4over6 keeps map-to-4 where the two errors tie",
             (("pick4 = err4 < err6 ", "pick4 = err4 <= err6 "),),
             REFERENCE_BYTES[:1]),
    Mutation("fourover6_bound_ignored", "reference", "4over6's global scale uses 448 whatever the bound",
             (("s_enc = encode_scale(amax, options.e4m3_bound).reshape(-1, 1, 1)",
               "s_enc = encode_scale(amax).reshape(-1, 1, 1)"),),
             REFERENCE_BYTES[:1]),
    Mutation("gemm_column_factors_of_first_row", "reference", "a per-row B amax (row-scaled wgrad) read as its first",
             (("alpha = (decode_scale(a_amax, a_e4m3_bound).reshape(-1, 1) * decode_scale(b_amax, b_e4m3_bound)",
               "alpha = (decode_scale(a_amax, a_e4m3_bound).reshape(-1, 1) * decode_scale(b_amax[:1], b_e4m3_bound)"),),
             ("tests/test_gemm.py", *LAYERS)),
    # ------------------------------------------------------------------------------------------ kernels' host glue
    Mutation("force_reference_ignored", "ops", "NVFP4_FORCE_REFERENCE=1 no longer sends CUDA tensors to the reference",
             (("return tensor.is_cuda and not environment.FORCE_REFERENCE.read()", "return tensor.is_cuda"),),
             ("tests/test_ops.py::test_force_reference_routes_cuda_tensors_to_the_reference",)),
    Mutation("force_reference_ignored_by_gemm", "ops", "the GEMM dispatch ignores NVFP4_FORCE_REFERENCE=1",
             (('if backend == "auto" and environment.FORCE_REFERENCE.read():', "if False:"),),
             ("tests/test_ops.py::test_force_reference_routes_cuda_tensors_to_the_reference",)),
    Mutation("sr_on_activations", "ops", "stochastic rounding applied to activations as well as gradients",
             (('stochastic_rounding=role == "gradient" and recipe.stochastic_rounding',
               'stochastic_rounding=role != "weight" and recipe.stochastic_rounding'),),
             ("tests/test_ops.py", *LAYERS)),
    Mutation("sr_row_offset_dropped", "ops", "quantize() passes sr_row_offset 0 to the backend",
             (("sr_row_offset=sr_row_offset, amax_rowwise=amax_rowwise, amax_columnwise=amax_columnwise, **options)",
               "sr_row_offset=0, amax_rowwise=amax_rowwise, amax_columnwise=amax_columnwise, **options)"),),
             ("tests/test_parallel_comm.py", *LAYERS)),
    Mutation("kernel_sr_rule_less_or_equal", "kernels", "the CUDA SR rule rounds up when bits <= p * 65536",
             (("return (255u << 24) | (bits16 << 8) | 1u;", "return (255u << 24) | (bits16 << 8);"),),
             ("tests/test_kernels_cpu.py::test_stochastic_rounding_ties_of_the_random_bits",
              "tests/test_kernels_cpu.py::test_fp4_rounding_matches_reference")),
    Mutation("kernel_philox_rounds", "kernels", "the CUDA SR bits from 10 Philox rounds",
             (("constexpr int kStochasticRoundingPhiloxRounds = 7;", "constexpr int kStochasticRoundingPhiloxRounds = 10;"),),
             ("tests/test_kernels_cpu.py::test_philox_matches_reference",
              "tests/test_kernels_cpu.py::test_stochastic_rounding_matches_reference")),
    Mutation("conversion_ties_to_odd", "kernels", "the model of Blackwell's FP4 conversion rounds ties to the odd code",
             (("if (a < midpoint || (a == midpoint && k % 2 == 0)) {", "if (a < midpoint || (a == midpoint && k % 2 == 1)) {"),),
             ("tests/test_kernels_cpu.py::test_conversion_rule_rounds_as_the_reference",
              "tests/test_kernels_cpu.py::test_bin_edges_and_extremes_match_reference")),
    Mutation("conversion_nibble_order", "kernels", "the Blackwell encoding packs each pair's elements in swapped nibbles",
             (("word |= fp4_code_by_conversion_rule(v[i]) << (4 * i);",
               "word |= fp4_code_by_conversion_rule(v[i]) << (4 * (i ^ 1));"),),
             ("tests/test_kernels_cpu.py::test_block_numerics_match_reference",
              "tests/test_kernels_cpu.py::test_bin_edges_and_extremes_match_reference")),
    Mutation("fourover6_conversion_value_halves", "kernels", "the Blackwell 4over6 errors take each pair's FP4 values "
             "in swapped halves", (("pairs[p] = half_bits(2 * p) | (half_bits(2 * p + 1) << 16);",
                                    "pairs[p] = half_bits(2 * p + 1) | (half_bits(2 * p) << 16);"),),
             ("tests/test_kernels_cpu_fourover6.py::test_kernel_numerics_on_golden_inputs",
              "tests/test_kernels_cpu_fourover6.py::test_kernel_numerics_on_near_ties")),
    Mutation("activation_rule_below_table", "kernels", "below the tables the activation is x, not x * 0.5",
             (("return magnitude < table.first ? x * 0.5f : (x > 0.0f ? x : x * 0.0f);",
               "return magnitude < table.first ? x : (x > 0.0f ? x : x * 0.0f);"),),
             ("tests/test_fused_kernels_cpu.py::test_activation_tables_equal_the_formulas_on_every_bf16_input",)),
    Mutation("gelu_pair_below_table", "kernels", "GELU of two BF16 values a word: the low one below the table not halved",
             (("return (looked_up & in_window) | ((w - 0x00800080u) & ~in_window);",
               "return (looked_up & in_window) | ((w - 0x00800000u) & ~in_window);"),),
             ("tests/test_fused_kernels_cpu.py::test_gelu_pairs_by_word_arithmetic_equal_the_formula",)),
    Mutation("silu_pair_high_sign", "kernels", "SiLU of two BF16 values a word: the high one's sign taken from the low one",
             (("high = table[((v >> 16) & 0xFFFu) | ((w >> 19) & 0x1000u)];",
               "high = table[((v >> 16) & 0xFFFu) | ((w >> 3) & 0x1000u)];"),),
             ("tests/test_fused_kernels_cpu.py::test_silu_pairs_by_word_arithmetic_equal_the_formula",)),
    # ------------------------------------------------------------------------------------------------------ comm
    Mutation("swap_first_dims_order", "comm", "swap_first_dims reshapes (W, K, X) without swapping W and K",
             (("return gathered.reshape(world_size, rows // world_size, cols).transpose(0, 1).reshape(rows // world_size, "
               "world_size * cols)", "return gathered.reshape(rows // world_size, world_size * cols)"),),
             ("tests/test_parallel_comm.py",)),
    Mutation("amax_reduce_sum", "comm", "the amax all-reduce sums instead of taking the maximum",
             (("dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)",
               "dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)"),),
             ("tests/test_parallel_comm.py",)),
    Mutation("gathered_columnwise_not_swapped", "comm", "the NVFP4 all-gather leaves columnwise pieces unswapped",
             (("if name in fields and not swapped:", "if name in fields and swapped:"),),
             ("tests/test_parallel_comm.py", *LAYERS)),
    # ---------------------------------------------------------------------------------------------------- layers
    Mutation("dgrad_uses_rowwise_weight", "layers", "dgrad multiplies by the weight's rowwise copy",
             (('return hot_path.gemm(dyq, wq, a_copy="rowwise", b_copy="columnwise", out_dtype=out_dtype, recipe=recipe)',
               'return hot_path.gemm(dyq, wq, a_copy="rowwise", b_copy="rowwise", out_dtype=out_dtype, recipe=recipe)'),),
             LAYERS),
    Mutation("row_parallel_sr_offset", "layers", "row-parallel SP gradient shards draw SR bits from row 0",
             (("sr_row_offset=self.rank * dy2d.shape[0])", "sr_row_offset=0)"),),
             LAYERS),
    Mutation("column_parallel_amax_not_reduced", "layers", "column-parallel SP input quantized with its shard's amax",
             (("collectives.all_reduce_amax([None if recipe.row_scaled_activation else amax_rowwise, amax_columnwise],",
               "collectives.all_reduce_amax([None, None],"),),
             LAYERS),
    # --------------------------------------------------------------------------------------------------- overlap
    Mutation("overlap_factory_without_row_parallel", "overlap", "overlapped_comm loses its row-parallel branch",
             (("    if isinstance(comm, RowParallelComm):\n"
               "        return OverlappedRowParallelComm(comm.group, comm.sequence_parallel, min_chunk_gflops, measure_links,\n"
               "                                         transport)\n",
               ""),),
             ("tests/test_matrix_cpu.py::test_quick_matrix_report", *LAYERS)),
    Mutation("ring_all_gather_order", "overlap", "the ring consumes chunks as if they came from rank + step",
             (("return [(rank - step) % world_size for step in range(world_size)]",
               "return [(rank + step) % world_size for step in range(world_size)]"),),
             ("tests/test_overlap_schedule.py", *LAYERS)),
    Mutation("columnwise_carry_placement", "overlap", "the carried columnwise blocks land in mirrored columns",
             (("gathered_data[:, source * data_cols:(source + 1) * data_cols].copy_(pieces[0])",
               "gathered_data[:, (world_size - 1 - source) * data_cols:(world_size - source) * data_cols]"
               ".copy_(pieces[0])"),),
             ("tests/test_overlap_layers.py",)),
    Mutation("split_gather_piece_rows", "overlap", "split collectives put each piece's rows at the start of its "
             "source's block", (("            first = source * rows + start\n",
                                 "            first = source * rows\n"),),
             ("tests/test_overlap_layers.py",)),
    Mutation("split_scatter_piece_rows", "overlap", "a split reduce-scatter's piece GEMM takes the first rows of "
             "each destination's block instead of the piece's", (("[(c * rows + start, c * rows + stop) for c in "
                                                                  "range(world_size)]",
                                                                  "[(c * rows, c * rows + stop - start) for c in "
                                                                  "range(world_size)]"),),
             ("tests/test_overlap_layers.py",)),
    Mutation("split_pieces_shrinking", "overlap", "a comm-bound reduce-scatter's pieces shrink instead of growing, "
             "so its largest piece's GEMMs run in the open", (("return SIZED_PIECES_RATIO if comm_bound else 1.0",
                                                               "return 1 / SIZED_PIECES_RATIO if comm_bound else 1.0"),),
             ("tests/test_overlap_links.py",)),
    Mutation("split_saving_of_the_larger", "overlap", "split collectives credited with hiding the larger of "
             "communication and GEMMs", (("saving += (pieces - 1) / pieces * min((world_size - 1) * collective, "
                                          "world_size * gemm)",
                                          "saving += (pieces - 1) / pieces * max((world_size - 1) * collective, "
                                          "world_size * gemm)"),),
             ("tests/test_overlap_links.py",)),
    Mutation("pipelining_for_any_saving", "overlap", "a pipelined path taken for any expected saving, however small "
             "against the plain path", (("path = best if savings[best] > 0 and savings[best] >= enough else \"plain\"",
                                         "path = best if savings[best] > 0 else \"plain\""),),
             ("tests/test_overlap_links.py",)),
    # -------------------------------------------------------------------------------------------------- megatron
    Mutation("megatron_strided_shards", "megatron", "GLU (stride 2) shards taken as contiguous chunks",
             (("return torch.cat([chunks[rank + tp_size * j] for rank in range(tp_size) for j in range(stride)],",
               "return torch.cat([chunks[rank * stride + j] for rank in range(tp_size) for j in range(stride)],"),),
             ("tests/test_megatron.py::test_adapters_match_megatron_contract",)),
    Mutation("megatron_row_checkpoint_axis", "megatron", "row-parallel weight checkpointed as sharded along dim 0",
             (('metadata, {"weight": 1})', 'metadata, {"weight": 0})'),),
             ("tests/test_megatron.py::test_adapters_match_megatron_contract",)),
    Mutation("layer_spec_unfused_by_default", "megatron", "the single-layer spec keeps Megatron's local structure "
             "unless asked (its norms outside the linears)",
             (("sdpa_attention: bool = True, fused_producers: bool = True,\n                             **local_spec_kwargs)",
               "sdpa_attention: bool = True, fused_producers: bool = False,\n                             **local_spec_kwargs)"),),
             ("tests/test_megatron.py::test_specs_fuse_the_producers_at_tp2",)),
    # ---------------------------------------------------------------------------------------------- checkpointing
    Mutation("checkpoint_rng_not_restored", "checkpoint", "resuming from a checkpoint leaves torch's RNG unrestored",
             (('    torch.set_rng_state(state["torch"])\n', ""),),
             ("tests/test_train_job.py::test_short_run_trains_saves_and_resumes_exactly",)),
    Mutation("checkpoint_records_the_flag_not_the_structure", "checkpoint", "a checkpoint records --fused-producers "
             "as given (None when left out) instead of the structure the model was built with",
             (('"world_size": plan.world_size, "fused_producers": plan.fused_producers, "fsdp": plan.fsdp}',
               '"world_size": plan.world_size, "fused_producers": args.fused_producers, "fsdp": plan.fsdp}'),),
             ("tests/test_train_job.py::test_megatron_model_trains_with_fused_producers_and_resumes_only_with_them",)),
    # ------------------------------------------------------------------------------- topology (TP x DP, TP x PP)
    Mutation("gradient_amax_reduced_over_world", "topology", "the row-parallel SP gradient's amaxes reduced over the "
             "world instead of the layer's TP group (mixes the data-parallel replicas' scales)",
             (("collectives.all_reduce_amax(amaxes, self.group)", "collectives.all_reduce_amax(amaxes)"),),
             TOPOLOGY_LAYERS),
    Mutation("input_amax_reduced_over_world", "topology", "the column-parallel SP input's amaxes reduced over the "
             "world instead of the layer's TP group",
             (("amax_columnwise],\n                                    self.group)", "amax_columnwise])"),),
             TOPOLOGY_LAYERS),
    Mutation("finite_check_over_world", "topology", "the NaN/Inf check exchanged over the world: a NaN in one "
             "replica stops the others", (("collectives.all_reduce_amax([agreed], group)",
                                            "collectives.all_reduce_amax([agreed])"),),
             TOPOLOGY_CHECKS),
    Mutation("consistency_records_over_world", "topology", "the consistency records gathered over the world: a "
             "disagreement in one replica stops the others",
             (("records = collectives.all_gather_stacked(local, group).tolist()",
               "records = collectives.all_gather_stacked(local).tolist()"),),
             TOPOLOGY_CHECKS),
    Mutation("ring_peers_as_group_ranks", "topology", "the pipelined ring sends to the next rank of the group as if "
             "it were a global rank", (("next_rank = dist.get_global_rank(group, (rank + 1) % world_size) if group "
                                        "is not None else (rank + 1) % world_size",
                                        "next_rank = (rank + 1) % world_size"),),
             ("tests/test_topology_layers.py::test_layers_match_the_oracle_of_their_own_group",)),
    Mutation("sequence_parallel_grads_over_world", "topology", "nvfp4-train sums the sequence-parallel gradients "
             "over the world instead of the TP group", (("    dist.all_reduce(flat, group=tp_group)\n",
                                                         "    dist.all_reduce(flat)\n"),),
             TOPOLOGY_TRAIN),
    Mutation("gradient_norm_over_world", "topology", "nvfp4-train's gradient norm sums the sharded squares over the "
             "world instead of the TP group", (("dist.all_reduce(sharded_sq, group=tp_group)",
                                                "dist.all_reduce(sharded_sq)"),),
             TOPOLOGY_TRAIN),
    # ------------------------------------------------------------------------------ tensor-parallel consistency
    Mutation("consistency_without_grad_mode", "consistency", "the consistency record leaves out the grad mode "
             "(a rank under torch.no_grad() beside one with grad)",
             (('              ("grad enabled", "int", torch.is_grad_enabled()),\n', ""),), CONSISTENCY),
    Mutation("consistency_without_weight_requires_grad", "consistency", "the consistency record leaves out "
             "weight.requires_grad", (('              ("weight.requires_grad", "int", layer.weight.requires_grad),\n', ""),),
             CONSISTENCY),
    Mutation("consistency_without_input_requires_grad", "consistency", "the consistency record leaves out "
             "input.requires_grad", ((',\n              ("input.requires_grad", "int", is_tensor and x.requires_grad)]',
                                      "]"),), CONSISTENCY),
    Mutation("consistency_without_parameter_requires_grad", "consistency", "the consistency record leaves out "
             "whether the bias (and norm parameters) take a gradient",
             ((',\n            (f"{name}.requires_grad", "int", present and parameter.requires_grad)]', "]"),),
             CONSISTENCY),
    Mutation("consistency_without_input_dtype", "consistency", "the consistency record leaves out the input dtype",
             (('              ("input dtype", "dtype", x.dtype if is_tensor else None),\n', ""),), CONSISTENCY),
    Mutation("consistency_without_delay_wgrad", "consistency", "the consistency record leaves out delay_wgrad",
             (('              ("delay_wgrad", "int", layer.delay_wgrad),\n', ""),), CONSISTENCY),
    # ------------------------------------------------------------------------------------- collective timeouts
    Mutation("collective_timeout_unexplained", "timeouts", "a layer's collective that times out raises gloo's bare "
             "error (no layer, group or missing rank)",
             (("            if not any(word in str(error).lower() for word in _TIMEOUT_WORDS):\n",
               "            if True:\n"),), TIMEOUTS),
    Mutation("collective_timeout_arrivals_inverted", "timeouts", "the ranks that reported arriving are named as "
             "the ones that did not", (("missing = [rank for rank in missing if not store.check([f\"{prefix}/{rank}\"])]",
                                        "missing = [rank for rank in missing if store.check([f\"{prefix}/{rank}\"])]"),),
             TIMEOUTS),
    # -------------------------------------------------------------------------------------------- blind spots
    Mutation("checkpoint_digest_first_chunk_only", "checkpoint", "a checkpoint file's digest and size cover only "
             "its first read chunk", (("        while chunk := handle.read(READ_CHUNK):\n",
                                        "        if chunk := handle.read(READ_CHUNK):\n"),),
             ("tests/test_blind_spots_checkpoint.py",)),
    Mutation("checkpoint_size_of_the_last_chunk", "checkpoint", "a checkpoint file's size counted as its last "
             "chunk's", (("            size += len(chunk)\n", "            size = len(chunk)\n"),),
             ("tests/test_blind_spots_checkpoint.py::test_digest_covers_every_chunk",)),
    Mutation("recipe_map_cached_across_bases", "recipes", "a recipe map reuses what it resolved for a layer under "
             "one base recipe under every other base", (("        key = (name, base)\n", "        key = name\n"),),
             ("tests/test_recipe_map.py::test_one_map_resolves_each_base_anew",)),
    Mutation("rht_dequantize_ignores_random_sign", "reference", "dequantizing an RHT columnwise copy made without "
             "random signs applies the signs anyway",
             (("return inverse_rht_chunks(chunks, random_sign).reshape(cols, rows).t()",
               "return inverse_rht_chunks(chunks).reshape(cols, rows).t()"),), DEQUANTIZE),
    Mutation("rht_dequantize_without_signs", "reference", "dequantizing an RHT columnwise copy leaves out the "
             "random signs", (("    return torch.where(_signs(random_sign, y.device) < 0, 0.0 - sums, sums)\n",
                               "    return sums\n"),), DEQUANTIZE),
    Mutation("columnwise_dequantize_without_inverse_rht", "reference", "an RHT columnwise copy dequantized as if "
             "it had no RHT", (("x2d = inverse_rht_transpose(x_t, q.rht_random_sign) if q.rht else x_t.t()",
                                "x2d = x_t.t()"),), DEQUANTIZE),
    Mutation("columnwise_dequantize_not_transposed", "reference", "a columnwise copy without the RHT dequantized "
             "without transposing it back (its values laid out as x^T in x's shape)",
             (("x2d = inverse_rht_transpose(x_t, q.rht_random_sign) if q.rht else x_t.t()",
               "x2d = inverse_rht_transpose(x_t, q.rht_random_sign) if q.rht else x_t"),), DEQUANTIZE),
    Mutation("dequantize_ignores_the_4over6_bound", "reference", "the rowwise copy dequantized with the 448 bound "
             "whatever it was quantized with",
             (("x2d = dequantize_blocks(q.rowwise_data, q.rowwise_scale, q.amax_rowwise, e4m3_bound=q.e4m3_bound)",
               "x2d = dequantize_blocks(q.rowwise_data, q.rowwise_scale, q.amax_rowwise)"),), DEQUANTIZE),
    # ------------------------------------------------------------------------------------- launcher edges, caches
    Mutation("out_dir_not_probed", "launch", "--out-dir taken on trust: no directory or probe file made before start",
             (('    probe_directory("--out-dir", out_dir)\n', "    pass\n"),),
             ("tests/test_train_job.py::test_an_out_dir_that_permissions_allow_but_writes_fail_is_refused_before_start",)),
    Mutation("watchdog_verdict_signature_unchecked", "launch", "a watchdog verdict followed whoever wrote it",
             (("return (int(rank), verdict) if hmac.compare_digest(signature, expected) else None",
               "return (int(rank), verdict)"),),
             ("tests/test_faults.py::test_a_verdict_is_signed_by_the_secret_and_the_rank",)),
    Mutation("gpu_per_process_counts_the_world", "launch", "a launched CUDA job's processes counted over all "
             "machines, not this one's: torchrun jobs across nodes refused",
             (("local = next((int(value) for value in values if value.isdigit()), None)", "local = world_size"),),
             ("tests/test_train_job.py::test_more_processes_than_gpus_on_a_machine_are_refused_before_nccl",)),
    Mutation("recipe_line_every_field", "launch", "the first line lists every recipe field, not those that differ",
             (("if getattr(recipe, field.name) != field.default]", "if True]"),),
             ("tests/test_train_job.py::test_the_first_line_shows_the_recipe_by_what_differs_from_its_defaults",)),
    Mutation("watchdog_follower_silent", "launch", "a rank stopped by another rank's verdict says nothing",
             (("stopping: rank {origin}'s watchdog stopped the job: \"\n                  f\"{verdict}\", file=sys.stderr",
               "stopping: rank {origin}'s watchdog stopped the job: \"\n                  f\"{verdict}\", file=open(os.devnull, \"w\")"),),
             ("tests/test_faults.py::test_a_following_rank_says_whose_verdict_stopped_the_job",)),
    Mutation("recipe_from_env_cached_whatever_the_environment", "recipes", "recipes from the environment reused "
             "after the variables changed",
             (("key = (cls, environment.raw_values(_RECIPE_NAMES),", "key = (cls, (),"),),
             ("tests/test_hot_path_caches.py::test_an_environment_change_takes_effect_at_the_next_call",)),
    Mutation("variable_read_kept_whatever_the_text", "recipes", "an environment variable's parsed value kept after "
             "its text changed", (("parsed = _PARSED.get((self.name, raw), _MISSING)",
                                   "parsed = _PARSED.get(self.name, _MISSING)"),
                                  ("_PARSED[(self.name, raw)] = parsed", "_PARSED[self.name] = parsed")),
             ("tests/test_environment.py::test_reads_follow_every_change_and_never_keep_a_refusal",)),
    Mutation("scaled_mm_path_takes_unpadded_k", "ops", "the cuBLASLt FP4 hot path takes a K that cuBLASLt needs "
             "padded", (("and packed_k % 16 == 0 and cols % 16 == 0 and", "and cols % 16 == 0 and"),),
             ("tests/test_hot_path_routes.py::test_operands_cublaslt_needs_padded_or_copied_go_to_gemm",)),
    Mutation("scaled_mm_path_takes_any_bias", "ops", "the cuBLASLt FP4 hot path hands the epilogue kernel a bias "
             "dtype it cannot read", (("bias.dtype in _OUT_DTYPE_CODES", "bias.is_floating_point()"),),
             ("tests/test_hot_path_routes.py::test_what_the_epilogue_kernel_cannot_do_goes_to_gemm",)),
    Mutation("seed_tensor_ignored_by_the_reference", "ops", "a seed given as a tensor quantized with seed 0 on the "
             "reference path", (("sr_seed = int(sr_seed.item())  # the reference takes the seed as an int",
                                 "sr_seed = 0"),),
             ("tests/test_graph_support_cpu.py::test_a_seed_tensor_quantizes_as_its_int",)),
)
