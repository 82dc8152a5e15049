// Thin torch bindings of the NVFP4 kernels (module nvfp4_dist._C). Validation of user input lives
// in nvfp4_dist/kernels.py; the checks here only guard the raw-pointer contract of each launcher.
// The caller passes the CUDA stream as an integer (torch.cuda.current_stream().cuda_stream) and has
// made the tensors' device current, so this file needs no CUDA-specific torch headers.
#include <algorithm>
#include <optional>
#include <vector>

#include <torch/extension.h>

#include "nvfp4_kernels.h"

namespace {

using nvfp4::InputType;

InputType input_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return InputType::kFloat32;
    case at::kHalf: return InputType::kFloat16;
    case at::kBFloat16: return InputType::kBFloat16;
    default: TORCH_CHECK(false, "nvfp4_dist._C: unsupported dtype ", t.scalar_type());
  }
}

void check_device_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "nvfp4_dist._C: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "nvfp4_dist._C: ", name, " must be contiguous");
}

void check_input(const at::Tensor& x) {
  check_device_tensor(x, "x");
  TORCH_CHECK(x.dim() == 2, "nvfp4_dist._C: x must be 2D");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "nvfp4_dist._C: x must be 16-byte aligned");
}

cudaStream_t as_stream(int64_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

uint8_t* bytes(const at::Tensor& t) { return reinterpret_cast<uint8_t*>(t.data_ptr()); }
uint8_t* optional_bytes(const std::optional<at::Tensor>& t) { return t.has_value() ? bytes(*t) : nullptr; }
const float* optional_floats(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

// The copies a cast writes (absent ones null) and their amaxes, into QuantizeArgs or ProducerCastArgs.
template <typename Args>
void set_copies(Args& args, const std::optional<at::Tensor>& amax_rowwise,
                const std::optional<at::Tensor>& amax_columnwise, const std::optional<at::Tensor>& rowwise_data,
                const std::optional<at::Tensor>& rowwise_scale, const std::optional<at::Tensor>& columnwise_data,
                const std::optional<at::Tensor>& columnwise_scale) {
  args.amax_rowwise = optional_floats(amax_rowwise);
  args.amax_columnwise = optional_floats(amax_columnwise);
  args.rowwise_data = optional_bytes(rowwise_data);
  args.rowwise_scale = optional_bytes(rowwise_scale);
  args.columnwise_data = optional_bytes(columnwise_data);
  args.columnwise_scale = optional_bytes(columnwise_scale);
}

void check_launch(cudaError_t status, const char* what) {
  TORCH_CHECK(status == cudaSuccess, "nvfp4_dist._C.", what, " failed: ", cudaGetErrorString(status));
}

void amax_tensor(const at::Tensor& x, at::Tensor& amax, int64_t stream) {
  check_input(x);
  check_launch(nvfp4::launch_amax_tensor(x.data_ptr(), input_type(x), x.size(0), x.size(1), amax.data_ptr<float>(),
                                         as_stream(stream)),
               "amax_tensor");
}

void amax_rows(const at::Tensor& x, at::Tensor& amax, int64_t stream) {
  check_input(x);
  TORCH_CHECK(amax.numel() == x.size(0), "nvfp4_dist._C.amax_rows: amax needs one element per row");
  check_launch(nvfp4::launch_amax_rows(x.data_ptr(), input_type(x), x.size(0), x.size(1), amax.data_ptr<float>(),
                                       as_stream(stream)),
               "amax_rows");
}

void amax_columns(const at::Tensor& x, bool rht, bool random_sign, at::Tensor& amax, int64_t stream) {
  check_input(x);
  TORCH_CHECK(amax.numel() == x.size(1), "nvfp4_dist._C.amax_columns: amax needs one element per column");
  TORCH_CHECK(!rht || x.scalar_type() == at::kBFloat16, "nvfp4_dist._C.amax_columns: the RHT takes bfloat16 x");
  check_launch(nvfp4::launch_amax_columns(x.data_ptr(), input_type(x), x.size(0), x.size(1), rht, random_sign,
                                          amax.data_ptr<float>(), as_stream(stream)),
               "amax_columns");
}

void amax_rht(const at::Tensor& x, bool random_sign, const std::optional<at::Tensor>& amax_plain, at::Tensor& amax_rht, int64_t stream) {
  check_input(x);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "nvfp4_dist._C.amax_rht: x must be bfloat16");
  float* plain = amax_plain.has_value() ? amax_plain->data_ptr<float>() : nullptr;
  check_launch(nvfp4::launch_amax_rht(x.data_ptr(), x.size(0), x.size(1), random_sign, plain, amax_rht.data_ptr<float>(),
                                      as_stream(stream)),
               "amax_rht");
}

// The QuantizeArgs that quantize and quantize_segmented share: x, the copies' outputs (and amaxes), the 1D/2D, RHT
// and SR options; `name` is the binding in error messages.
nvfp4::QuantizeArgs cast_args(const at::Tensor& x, const std::optional<at::Tensor>& amax_rowwise,
                              const std::optional<at::Tensor>& amax_columnwise,
                              const std::optional<at::Tensor>& rowwise_data,
                              const std::optional<at::Tensor>& rowwise_scale,
                              const std::optional<at::Tensor>& columnwise_data,
                              const std::optional<at::Tensor>& columnwise_scale, bool block_2d, bool rht,
                              bool rht_random_sign, bool stochastic_rounding, int64_t sr_seed,
                              const std::optional<at::Tensor>& sr_seed_device, int64_t sr_row_offset,
                              const char* name) {
  nvfp4::QuantizeArgs args{};
  args.x = x.data_ptr();
  args.type = input_type(x);
  args.rows = x.size(0);
  args.cols = x.size(1);
  set_copies(args, amax_rowwise, amax_columnwise, rowwise_data, rowwise_scale, columnwise_data, columnwise_scale);
  args.block_2d = block_2d;
  args.rht = rht;
  args.rht_random_sign = rht_random_sign;
  args.stochastic_rounding = stochastic_rounding;
  args.sr_seed = static_cast<uint64_t>(sr_seed);
  if (sr_seed_device.has_value()) {
    check_device_tensor(*sr_seed_device, "sr_seed_device");
    TORCH_CHECK(sr_seed_device->scalar_type() == at::kLong && sr_seed_device->numel() == 1,
                "nvfp4_dist._C.", name, ": sr_seed_device must be one int64 value");
    args.sr_seed_device = sr_seed_device->data_ptr<int64_t>();
  }
  args.sr_row_offset = sr_row_offset;
  return args;
}

void quantize(const at::Tensor& x, const std::optional<at::Tensor>& amax_rowwise,
              const std::optional<at::Tensor>& amax_columnwise, const std::optional<at::Tensor>& rowwise_data,
              const std::optional<at::Tensor>& rowwise_scale, const std::optional<at::Tensor>& columnwise_data,
              const std::optional<at::Tensor>& columnwise_scale, bool row_scaled, bool block_2d, bool rht,
              bool rht_random_sign, bool stochastic_rounding, int64_t sr_seed,
              const std::optional<at::Tensor>& sr_seed_device, int64_t sr_row_offset, bool four_over_six,
              int64_t e4m3_bound, bool four_over_six_mse, bool four_over_six_fast_math,
              int64_t stream) {
  check_input(x);
  TORCH_CHECK(rowwise_data.has_value() == amax_rowwise.has_value() && rowwise_data.has_value() == rowwise_scale.has_value(),
              "nvfp4_dist._C.quantize: the rowwise copy needs its data, scale and amax");
  TORCH_CHECK(columnwise_data.has_value() == amax_columnwise.has_value() &&
                  columnwise_data.has_value() == columnwise_scale.has_value(),
              "nvfp4_dist._C.quantize: the columnwise copy needs its data, scale and amax");
  nvfp4::QuantizeArgs args = cast_args(x, amax_rowwise, amax_columnwise, rowwise_data, rowwise_scale, columnwise_data,
                                       columnwise_scale, block_2d, rht, rht_random_sign, stochastic_rounding, sr_seed,
                                       sr_seed_device, sr_row_offset, "quantize");
  args.row_scaled = row_scaled;
  args.four_over_six = four_over_six;
  args.e4m3_bound = static_cast<int>(e4m3_bound);
  args.four_over_six_mse = four_over_six_mse;
  args.four_over_six_fast_math = four_over_six_fast_math;
  check_launch(nvfp4::launch_quantize(args, as_stream(stream)), "quantize");
}

// The segmented cast (nvfp4_dist/grouped_quantize.py): quantize's 1D/2D/RHT/SR cast with per-row rowwise amaxes
// (rows,) and per-16-row-chunk columnwise amaxes (rows / 16,) in place of the tensor amaxes.
void quantize_segmented(const at::Tensor& x, const std::optional<at::Tensor>& amax_rowwise_rows,
                        const std::optional<at::Tensor>& amax_columnwise_chunks,
                        const std::optional<at::Tensor>& rowwise_data, const std::optional<at::Tensor>& rowwise_scale,
                        const std::optional<at::Tensor>& columnwise_data,
                        const std::optional<at::Tensor>& columnwise_scale, bool block_2d, bool rht,
                        bool rht_random_sign, bool stochastic_rounding, int64_t sr_seed,
                        const std::optional<at::Tensor>& sr_seed_device, int64_t sr_row_offset, int64_t stream) {
  check_input(x);
  TORCH_CHECK(rowwise_data.has_value() == amax_rowwise_rows.has_value() &&
                  rowwise_data.has_value() == rowwise_scale.has_value(),
              "nvfp4_dist._C.quantize_segmented: the rowwise copy needs its data, scale and row amaxes");
  TORCH_CHECK(columnwise_data.has_value() == amax_columnwise_chunks.has_value() &&
                  columnwise_data.has_value() == columnwise_scale.has_value(),
              "nvfp4_dist._C.quantize_segmented: the columnwise copy needs its data, scale and chunk amaxes");
  TORCH_CHECK(rowwise_data.has_value() || columnwise_data.has_value(),
              "nvfp4_dist._C.quantize_segmented: no copy asked for");
  if (amax_rowwise_rows.has_value()) {
    check_device_tensor(*amax_rowwise_rows, "amax_rowwise_rows");
    TORCH_CHECK(amax_rowwise_rows->scalar_type() == at::kFloat && amax_rowwise_rows->numel() == x.size(0),
                "nvfp4_dist._C.quantize_segmented: amax_rowwise_rows needs one float32 per row");
  }
  if (amax_columnwise_chunks.has_value()) {
    check_device_tensor(*amax_columnwise_chunks, "amax_columnwise_chunks");
    TORCH_CHECK(x.size(0) % 16 == 0 && amax_columnwise_chunks->scalar_type() == at::kFloat &&
                    amax_columnwise_chunks->numel() == x.size(0) / 16,
                "nvfp4_dist._C.quantize_segmented: amax_columnwise_chunks needs one float32 per 16 rows");
  }
  nvfp4::QuantizeArgs args = cast_args(x, std::nullopt, std::nullopt, rowwise_data, rowwise_scale, columnwise_data,
                                       columnwise_scale, block_2d, rht, rht_random_sign, stochastic_rounding, sr_seed,
                                       sr_seed_device, sr_row_offset, "quantize_segmented");
  args.amax_rowwise_rows = optional_floats(amax_rowwise_rows);
  args.amax_columnwise_chunks = optional_floats(amax_columnwise_chunks);
  args.e4m3_bound = 448;
  check_launch(nvfp4::launch_quantize(args, as_stream(stream)), "quantize_segmented");
}

// Per 16-row chunk of BF16 x: the plain amax (amax_plain, optional) and the post-RHT amax, [rows / 16] each.
void amax_rht_chunks(const at::Tensor& x, bool random_sign, const std::optional<at::Tensor>& amax_plain,
                     at::Tensor& amax_rht, int64_t stream) {
  check_input(x);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(0) % 16 == 0,
              "nvfp4_dist._C.amax_rht_chunks: x must be bfloat16 with rows a multiple of 16");
  check_device_tensor(amax_rht, "amax_rht");
  TORCH_CHECK(amax_rht.scalar_type() == at::kFloat && amax_rht.numel() == x.size(0) / 16,
              "nvfp4_dist._C.amax_rht_chunks: amax_rht needs one float32 per 16 rows");
  if (amax_plain.has_value()) {
    check_device_tensor(*amax_plain, "amax_plain");
    TORCH_CHECK(amax_plain->scalar_type() == at::kFloat && amax_plain->numel() == x.size(0) / 16,
                "nvfp4_dist._C.amax_rht_chunks: amax_plain needs one float32 per 16 rows");
  }
  check_launch(nvfp4::launch_amax_rht_chunks(x.data_ptr(), x.size(0), x.size(1), random_sign,
                                             amax_plain.has_value() ? amax_plain->data_ptr<float>() : nullptr,
                                             amax_rht.data_ptr<float>(), as_stream(stream)),
               "amax_rht_chunks");
}

// Per-segment maxima of per-row (granule 1) or per-chunk (16) amaxes, and their expansion over the segments' rows
// and chunks (launch_segment_amaxes).
void segment_amaxes(const at::Tensor& plain, const std::optional<at::Tensor>& columnwise, int64_t granule,
                    const at::Tensor& offsets, at::Tensor& segment_plain, at::Tensor& segment_columnwise,
                    const std::optional<at::Tensor>& rows_out, const std::optional<at::Tensor>& chunks_out,
                    int64_t stream) {
  check_device_tensor(plain, "plain");
  check_device_tensor(offsets, "offsets");
  check_device_tensor(segment_plain, "segment_plain");
  check_device_tensor(segment_columnwise, "segment_columnwise");
  const int64_t segments = offsets.numel() - 1;
  TORCH_CHECK(offsets.scalar_type() == at::kLong && segments >= 0,
              "nvfp4_dist._C.segment_amaxes: offsets must be int64 [segments + 1]");
  TORCH_CHECK(plain.scalar_type() == at::kFloat && segment_plain.scalar_type() == at::kFloat &&
                  segment_columnwise.scalar_type() == at::kFloat && segment_plain.numel() == segments &&
                  segment_columnwise.numel() == segments,
              "nvfp4_dist._C.segment_amaxes: float32 amaxes, one per segment");
  if (columnwise.has_value()) {
    check_device_tensor(*columnwise, "columnwise");
    TORCH_CHECK(columnwise->scalar_type() == at::kFloat && columnwise->numel() == plain.numel(),
                "nvfp4_dist._C.segment_amaxes: columnwise must be float32 like plain");
  }
  for (const auto* out : {&rows_out, &chunks_out}) {
    if (out->has_value()) {
      check_device_tensor(**out, "rows_out / chunks_out");
      TORCH_CHECK((*out)->scalar_type() == at::kFloat, "nvfp4_dist._C.segment_amaxes: float32 outputs");
    }
  }
  check_launch(nvfp4::launch_segment_amaxes(plain.data_ptr<float>(), optional_floats(columnwise), granule,
                                            offsets.data_ptr<int64_t>(), segments, segment_plain.data_ptr<float>(),
                                            segment_columnwise.data_ptr<float>(),
                                            rows_out.has_value() ? rows_out->data_ptr<float>() : nullptr,
                                            chunks_out.has_value() ? chunks_out->data_ptr<float>() : nullptr,
                                            as_stream(stream)),
               "segment_amaxes");
}

// tensors: float32 CUDA tensors; each gives one value, its maximum, or (per_entry) each entry of the single tensor
// gives one. record: pinned host float32 [values + 1]; any_record: pinned host float32 [1].
void record_check(const std::vector<at::Tensor>& tensors, bool per_entry, at::Tensor& record, at::Tensor& any_record,
                  int64_t stream) {
  nvfp4::CheckedValues check{};
  for (const at::Tensor& t : tensors) {
    check_device_tensor(t, "values");
    TORCH_CHECK(t.scalar_type() == at::kFloat, "nvfp4_dist._C.record_check: values must be float32");
  }
  if (per_entry) {
    TORCH_CHECK(tensors.size() == 1 && tensors[0].numel() <= nvfp4::kMaxCheckedValues,
                "nvfp4_dist._C.record_check: per_entry takes one tensor of at most ", nvfp4::kMaxCheckedValues, " values");
    for (int64_t i = 0; i < tensors[0].numel(); ++i) {
      check.values[i] = tensors[0].data_ptr<float>() + i;
      check.counts[i] = 1;
    }
    check.count = static_cast<int>(tensors[0].numel());
  } else {
    TORCH_CHECK(!tensors.empty() && tensors.size() <= static_cast<size_t>(nvfp4::kMaxCheckedValues),
                "nvfp4_dist._C.record_check: 1 to ", nvfp4::kMaxCheckedValues, " tensors");
    for (size_t j = 0; j < tensors.size(); ++j) {
      check.values[j] = tensors[j].data_ptr<float>();
      check.counts[j] = tensors[j].numel();
    }
    check.count = static_cast<int>(tensors.size());
  }
  for (const at::Tensor* t : {&record, &any_record}) {
    TORCH_CHECK(!t->is_cuda() && t->is_pinned() && t->is_contiguous() && t->scalar_type() == at::kFloat,
                "nvfp4_dist._C.record_check: record and any_record must be contiguous pinned float32 host tensors");
  }
  TORCH_CHECK(record.numel() == check.count + 1 && any_record.numel() == 1,
              "nvfp4_dist._C.record_check: record must hold one float per value and a flag");
  check_launch(nvfp4::launch_record_check(check, record.data_ptr<float>(), any_record.data_ptr<float>(),
                                          as_stream(stream)),
               "record_check");
}

void dequantize_rowwise(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& amax, bool per_row_amax,
                        int64_t e4m3_bound, at::Tensor& out, int64_t stream) {
  check_device_tensor(data, "data");
  check_device_tensor(scale, "scale");
  check_device_tensor(out, "out");
  check_launch(nvfp4::launch_dequantize_rowwise(bytes(data), bytes(scale), amax.data_ptr<float>(), per_row_amax,
                                                static_cast<int>(e4m3_bound), 1.0f,
                                                out.size(0), out.size(1), out.data_ptr(), input_type(out),
                                                as_stream(stream)),
               "dequantize_rowwise");
}

// data [rows, K/2] 8-byte aligned, scale [rows, K/16], out [rows, K] 16-byte aligned, all contiguous.
void dequantize_block_values(const at::Tensor& data, const at::Tensor& scale, double factor, at::Tensor& out,
                             int64_t stream) {
  check_device_tensor(data, "data");
  check_device_tensor(scale, "scale");
  check_device_tensor(out, "out");
  TORCH_CHECK(out.dim() == 2 && data.dim() == 2 && scale.dim() == 2 && data.size(0) == out.size(0) &&
                  scale.size(0) == out.size(0) && 2 * data.size(1) == out.size(1) && 16 * scale.size(1) == out.size(1),
              "nvfp4_dist._C.dequantize_block_values: data [rows, K/2], scale [rows, K/16], out [rows, K]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(data.data_ptr()) % 8 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "nvfp4_dist._C.dequantize_block_values: data must be 8-byte and out 16-byte aligned");
  check_launch(nvfp4::launch_dequantize_rowwise(bytes(data), bytes(scale), nullptr, false, 448, static_cast<float>(factor),
                                                out.size(0), out.size(1), out.data_ptr(), input_type(out),
                                                as_stream(stream)),
               "dequantize_block_values");
}

void gemm_epilogue(const at::Tensor& acc, const at::Tensor& a_amax, const at::Tensor& b_amax,
                   const std::optional<at::Tensor>& bias, bool accumulate, int64_t a_e4m3_bound, int64_t b_e4m3_bound,
                   at::Tensor& out, int64_t stream) {
  TORCH_CHECK(acc.is_cuda() && acc.dim() == 2 && acc.scalar_type() == at::kFloat && acc.stride(1) == 1 &&
                  out.is_cuda() && out.dim() == 2 && out.stride(1) == 1 && out.sizes() == acc.sizes(),
              "nvfp4_dist._C.gemm_epilogue: acc FP32 and out of the same [rows, cols], rows of unit stride");
  check_device_tensor(a_amax, "a_amax");
  check_device_tensor(b_amax, "b_amax");
  const bool a_per_row = a_amax.numel() != 1;
  TORCH_CHECK(!a_per_row || a_amax.numel() == acc.size(0), "nvfp4_dist._C.gemm_epilogue: a_amax has 1 or rows elements");
  const bool b_per_column = b_amax.numel() != 1;
  TORCH_CHECK(!b_per_column || b_amax.numel() == acc.size(1),
              "nvfp4_dist._C.gemm_epilogue: b_amax has 1 or cols elements");
  if (bias.has_value()) {
    check_device_tensor(*bias, "bias");
    TORCH_CHECK(bias->numel() == acc.size(1), "nvfp4_dist._C.gemm_epilogue: bias has cols elements");
  }
  check_launch(nvfp4::launch_gemm_epilogue(acc.data_ptr<float>(), acc.stride(0), a_amax.data_ptr<float>(), a_per_row,
                                           b_amax.data_ptr<float>(), b_per_column, static_cast<int>(a_e4m3_bound),
                                           static_cast<int>(b_e4m3_bound),
                                           bias.has_value() ? bias->data_ptr() : nullptr,
                                           bias.has_value() ? input_type(*bias) : nvfp4::InputType::kFloat32,
                                           accumulate, acc.size(0), acc.size(1), out.data_ptr(), input_type(out),
                                           out.stride(0), as_stream(stream)),
               "gemm_epilogue");
}

void dequantize_columnwise(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& amax, bool per_row_amax,
                           int64_t e4m3_bound, bool rht, bool rht_random_sign, at::Tensor& out, int64_t stream) {
  check_device_tensor(data, "data");
  check_device_tensor(scale, "scale");
  check_device_tensor(out, "out");
  TORCH_CHECK(!per_row_amax || amax.numel() == out.size(1),
              "nvfp4_dist._C.dequantize_columnwise: a per-row amax has one element per row of x^T");
  check_launch(nvfp4::launch_dequantize_columnwise(bytes(data), bytes(scale), amax.data_ptr<float>(), per_row_amax,
                                                   static_cast<int>(e4m3_bound), out.size(0), out.size(1), rht,
                                                   rht_random_sign, out.data_ptr(), input_type(out), as_stream(stream)),
               "dequantize_columnwise");
}

constexpr int64_t kCublasWorkspaceBytes = 32 << 20;

// cublaslt_gemm with its two device scalars (alpha, beta) at `scalars` and the given workspace; scalars_ready: they
// already hold them (nvfp4::launch_gemm_scalars), else it computes them from the amaxes first.
bool cublaslt_gemm_using(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_amax, const at::Tensor& b_amax,
                         const std::optional<at::Tensor>& bias, bool accumulate, int64_t a_e4m3_bound,
                         int64_t b_e4m3_bound, at::Tensor& out, float* scalars, bool scalars_ready,
                         const at::Tensor& workspace, int64_t stream) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && out.is_cuda() && a.dim() == 2 && b.dim() == 2 && out.dim() == 2 &&
                  a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && a.stride(1) == 1 &&
                  b.stride(1) == 1 && out.stride(1) == 1 && a.size(1) == b.size(1) && out.size(0) == a.size(0) &&
                  out.size(1) == b.size(0),
              "nvfp4_dist._C.cublaslt_gemm: BF16 a [M, K], b [N, K] and out [M, N], rows of unit stride");
  check_device_tensor(a_amax, "a_amax");
  check_device_tensor(b_amax, "b_amax");
  TORCH_CHECK(a_amax.numel() == 1 && b_amax.numel() == 1, "nvfp4_dist._C.cublaslt_gemm: per-tensor amaxes");
  if (bias.has_value()) check_device_tensor(*bias, "bias");
  const cudaError_t status = nvfp4::launch_cublaslt_gemm(
      a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), a.size(0), b.size(0), a.size(1),
      scalars_ready ? nullptr : a_amax.data_ptr<float>(), b_amax.data_ptr<float>(), static_cast<int>(a_e4m3_bound),
      static_cast<int>(b_e4m3_bound),
      bias.has_value() ? bias->data_ptr() : nullptr,
      bias.has_value() ? input_type(*bias) : input_type(out), accumulate, out.data_ptr(), input_type(out), out.stride(0),
      scalars, workspace.data_ptr(), static_cast<size_t>(workspace.numel()), as_stream(stream));
  if (status == cudaErrorNotSupported) return false;
  check_launch(status, "cublaslt_gemm");
  return true;
}

// False when cuBLASLt has no algorithm for the problem (nothing launched): the caller takes another path.
bool cublaslt_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_amax, const at::Tensor& b_amax,
                   const std::optional<at::Tensor>& bias, bool accumulate, int64_t a_e4m3_bound, int64_t b_e4m3_bound,
                   at::Tensor& out, int64_t stream) {
  at::Tensor scalars = at::empty({2}, a_amax.options());
  at::Tensor workspace = at::empty({kCublasWorkspaceBytes}, a.options().dtype(at::kByte));
  return cublaslt_gemm_using(a, b, a_amax, b_amax, bias, accumulate, a_e4m3_bound, b_e4m3_bound, out,
                             scalars.data_ptr<float>(), false, workspace, stream);
}

// Bytes of a [rows, cols] scale tensor in the 128x4 swizzled layout: rows rounded up to 128, columns to 4.
int64_t swizzled_scale_bytes(const at::Tensor& scale) {
  return (scale.size(0) + 127) / 128 * 128 * ((scale.size(1) + 3) / 4 * 4);
}

void swizzle_scales(const at::Tensor& scale, at::Tensor& out, int64_t stream) {
  check_device_tensor(scale, "scale");
  check_device_tensor(out, "out");
  TORCH_CHECK(scale.dim() == 2 && scale.element_size() == 1 && out.element_size() == 1,
              "nvfp4_dist._C.swizzle_scales: scale must be 2D and both tensors of 1-byte elements");
  TORCH_CHECK(out.numel() == swizzled_scale_bytes(scale),
              "nvfp4_dist._C.swizzle_scales: out needs rows rounded up to 128 times columns rounded up to 4 bytes");
  check_launch(nvfp4::launch_swizzle_scales(bytes(scale), scale.size(0), scale.size(1), bytes(out),
                                            as_stream(stream)),
               "swizzle_scales");
}

void swap_first_dims(const at::Tensor& gathered, int64_t world_size, at::Tensor& out, int64_t stream) {
  check_device_tensor(gathered, "gathered");
  check_device_tensor(out, "out");
  const int64_t rows = gathered.size(0) / world_size;
  const int64_t row_bytes = gathered.size(1) * static_cast<int64_t>(gathered.element_size());
  check_launch(nvfp4::launch_swap_first_dims(bytes(gathered), world_size, rows, row_bytes, bytes(out),
                                             as_stream(stream)),
               "swap_first_dims");
}

void transpose_codes(const at::Tensor& packed, at::Tensor& out, int64_t stream) {
  check_device_tensor(packed, "packed");
  check_device_tensor(out, "out");
  TORCH_CHECK(packed.dim() == 2 && out.dim() == 2 && out.size(0) == 2 * packed.size(1) &&
                  2 * out.size(1) == packed.size(0),
              "nvfp4_dist._C.transpose_codes: packed [N, K/2] and out [K, N/2]");
  check_launch(nvfp4::launch_transpose_codes(bytes(packed), packed.size(0), 2 * packed.size(1), bytes(out),
                                             as_stream(stream)),
               "transpose_codes");
}

// Fused producers (norm_quantize.cu, activation_quantize.cu). x / h contiguous and 16-byte aligned; weight and bias
// FP32 [cols]; mean, rstd FP32 [rows]; the copies as quantize's.
nvfp4::NormArgs norm_args(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          int64_t normalization, double eps, const std::optional<at::Tensor>& mean,
                          const at::Tensor& rstd) {
  check_input(x);
  check_device_tensor(weight, "weight");
  check_device_tensor(rstd, "rstd");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == x.size(1) && rstd.scalar_type() == at::kFloat &&
                  rstd.numel() == x.size(0),
              "nvfp4_dist._C: norm weight FP32 [cols], rstd FP32 [rows]");
  const bool layer_norm = normalization == static_cast<int64_t>(nvfp4::Normalization::kLayerNorm);
  TORCH_CHECK(layer_norm == bias.has_value() && layer_norm == mean.has_value(),
              "nvfp4_dist._C: LayerNorm takes a bias and a mean, RMSNorm neither");
  if (layer_norm) {
    check_device_tensor(*bias, "bias");
    check_device_tensor(*mean, "mean");
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == x.size(1) && mean->scalar_type() == at::kFloat &&
                    mean->numel() == x.size(0),
                "nvfp4_dist._C: norm bias FP32 [cols], mean FP32 [rows]");
  }
  nvfp4::NormArgs args{};
  args.x = x.data_ptr();
  args.type = input_type(x);
  args.rows = x.size(0);
  args.cols = x.size(1);
  args.weight = weight.data_ptr<float>();
  args.bias = optional_floats(bias);
  args.normalization = layer_norm ? nvfp4::Normalization::kLayerNorm : nvfp4::Normalization::kRMSNorm;
  args.eps = static_cast<float>(eps);
  args.mean = mean.has_value() ? mean->data_ptr<float>() : nullptr;
  args.rstd = rstd.data_ptr<float>();
  return args;
}

nvfp4::ProducerCastArgs producer_cast_args(int64_t rows, int64_t cols, const std::optional<at::Tensor>& amax_rowwise,
                                           const std::optional<at::Tensor>& amax_columnwise,
                                           const std::optional<at::Tensor>& rowwise_data,
                                           const std::optional<at::Tensor>& rowwise_scale,
                                           const std::optional<at::Tensor>& columnwise_data,
                                           const std::optional<at::Tensor>& columnwise_scale, bool row_scaled, bool rht,
                                           bool rht_random_sign) {
  TORCH_CHECK(rowwise_data.has_value() == amax_rowwise.has_value() && rowwise_data.has_value() == rowwise_scale.has_value(),
              "nvfp4_dist._C: the rowwise copy needs its data, scale and amax");
  TORCH_CHECK(columnwise_data.has_value() == amax_columnwise.has_value() &&
                  columnwise_data.has_value() == columnwise_scale.has_value(),
              "nvfp4_dist._C: the columnwise copy needs its data, scale and amax");
  TORCH_CHECK(!rowwise_data.has_value() || (rowwise_data->numel() == rows * cols / 2 &&
                                            rowwise_scale->numel() == rows * cols / 16 &&
                                            amax_rowwise->numel() == (row_scaled ? rows : 1)),
              "nvfp4_dist._C: rowwise copy [rows, cols/2], scales [rows, cols/16], amax (1,) or (rows,)");
  TORCH_CHECK(!columnwise_data.has_value() || (columnwise_data->numel() == rows * cols / 2 &&
                                               columnwise_scale->numel() == rows * cols / 16 &&
                                               amax_columnwise->numel() == 1),
              "nvfp4_dist._C: columnwise copy [cols, rows/2], scales [cols, rows/16], amax (1,)");
  nvfp4::ProducerCastArgs args{};
  args.rows = rows;
  args.cols = cols;
  set_copies(args, amax_rowwise, amax_columnwise, rowwise_data, rowwise_scale, columnwise_data, columnwise_scale);
  args.row_scaled = row_scaled;
  args.rht = rht;
  args.rht_random_sign = rht_random_sign;
  return args;
}

void norm_rows(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
               int64_t normalization, double eps, const std::optional<at::Tensor>& mean, at::Tensor& rstd,
               const std::optional<at::Tensor>& sum_of_squares, const std::optional<at::Tensor>& y, const std::optional<at::Tensor>& amax_rowwise, bool row_scaled,
               const std::optional<at::Tensor>& amax_rht, bool rht_random_sign, int64_t stream) {
  nvfp4::NormArgs args = norm_args(x, weight, bias, normalization, eps, mean, rstd);
  if (sum_of_squares.has_value()) {
    check_device_tensor(*sum_of_squares, "sum_of_squares");
    TORCH_CHECK(sum_of_squares->scalar_type() == at::kFloat && sum_of_squares->numel() == x.size(0),
                "nvfp4_dist._C.norm_rows: sum_of_squares FP32 [rows]");
    args.sum_of_squares = sum_of_squares->data_ptr<float>();
  }
  if (y.has_value()) {
    check_device_tensor(*y, "y");
    TORCH_CHECK(y->numel() == x.numel(), "nvfp4_dist._C.norm_rows: y [rows, cols]");
  }
  TORCH_CHECK(!amax_rowwise.has_value() || amax_rowwise->numel() == (row_scaled ? x.size(0) : 1),
              "nvfp4_dist._C.norm_rows: amax_rowwise (1,) or (rows,)");
  check_launch(nvfp4::launch_norm_rows(args, y.has_value() ? y->data_ptr() : nullptr,
                                       y.has_value() ? input_type(*y) : nvfp4::InputType::kBFloat16,
                                       amax_rowwise.has_value() ? amax_rowwise->data_ptr<float>() : nullptr, row_scaled,
                                       amax_rht.has_value() ? amax_rht->data_ptr<float>() : nullptr, rht_random_sign,
                                       as_stream(stream)),
               "norm_rows");
}

void norm_cast(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
               int64_t normalization, const std::optional<at::Tensor>& mean, const at::Tensor& rstd,
               const std::optional<at::Tensor>& amax_rowwise, const std::optional<at::Tensor>& amax_columnwise,
               const std::optional<at::Tensor>& rowwise_data, const std::optional<at::Tensor>& rowwise_scale,
               const std::optional<at::Tensor>& columnwise_data, const std::optional<at::Tensor>& columnwise_scale,
               bool row_scaled, bool rht, bool rht_random_sign, int64_t stream) {
  const nvfp4::NormArgs args = norm_args(x, weight, bias, normalization, 1.0, mean, rstd);
  check_launch(nvfp4::launch_norm_cast(args,
                                       producer_cast_args(x.size(0), x.size(1), amax_rowwise, amax_columnwise, rowwise_data,
                                                          rowwise_scale, columnwise_data, columnwise_scale, row_scaled,
                                                          rht, rht_random_sign),
                                       as_stream(stream)),
               "norm_cast");
}

nvfp4::Activation activation_of(int64_t code) {
  return code == static_cast<int64_t>(nvfp4::Activation::kSwiglu) ? nvfp4::Activation::kSwiglu : nvfp4::Activation::kGelu;
}

nvfp4::ActivationArgs activation_args(const at::Tensor& h, int64_t activation, const std::optional<at::Tensor>& table) {
  check_input(h);
  nvfp4::ActivationArgs args{};
  args.activation = activation_of(activation);
  const bool swiglu = args.activation == nvfp4::Activation::kSwiglu;
  TORCH_CHECK(!swiglu || h.size(1) % 2 == 0, "nvfp4_dist._C: SwiGLU takes [rows, 2 cols]");
  args.h = h.data_ptr();
  args.type = input_type(h);
  args.rows = h.size(0);
  args.cols = swiglu ? h.size(1) / 2 : h.size(1);
  if (table.has_value() && h.scalar_type() == at::kBFloat16) {
    check_device_tensor(*table, "table");
    TORCH_CHECK(table->scalar_type() == at::kByte && table->is_contiguous() &&
                    table->numel() == nvfp4::activation_table_bytes(args.activation) &&
                    reinterpret_cast<uintptr_t>(table->data_ptr()) % nvfp4::kActivationTableAlignment == 0 &&
                    table->device() == h.device(),
                "nvfp4_dist._C: table: the activation's table from activation_table, on h's device");
    args.table = table->data_ptr();
  }
  return args;
}

void activation_table(int64_t activation, at::Tensor& out, int64_t stream) {
  check_device_tensor(out, "out");
  const nvfp4::Activation kind = activation_of(activation);
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.numel() == nvfp4::activation_table_bytes(kind),
              "nvfp4_dist._C.activation_table: out uint8 of activation_table_bytes(activation)");
  check_launch(nvfp4::launch_activation_table(kind, out.data_ptr(), as_stream(stream)), "activation_table");
}

int64_t activation_table_bytes(int64_t activation) {
  return nvfp4::activation_table_bytes(activation_of(activation));
}

void activation_forward(const at::Tensor& h, int64_t activation, at::Tensor& out, const std::optional<at::Tensor>& table,
                        int64_t stream) {
  const nvfp4::ActivationArgs args = activation_args(h, activation, table);
  check_device_tensor(out, "out");
  TORCH_CHECK(out.scalar_type() == h.scalar_type() && out.numel() == args.rows * args.cols,
              "nvfp4_dist._C.activation_forward: out [rows, cols] of h's dtype");
  check_launch(nvfp4::launch_activation(args, out.data_ptr(), as_stream(stream)), "activation_forward");
}

void activation_amaxes(const at::Tensor& h, int64_t activation, at::Tensor& amax_rowwise, bool row_scaled,
                       const std::optional<at::Tensor>& amax_rht, bool rht_random_sign,
                       const std::optional<at::Tensor>& table, int64_t stream) {
  const nvfp4::ActivationArgs args = activation_args(h, activation, table);
  TORCH_CHECK(amax_rowwise.numel() == (row_scaled ? args.rows : 1), "nvfp4_dist._C.activation_amaxes: amax (1,) or (rows,)");
  check_launch(nvfp4::launch_activation_amaxes(args, amax_rowwise.data_ptr<float>(), row_scaled,
                                               amax_rht.has_value() ? amax_rht->data_ptr<float>() : nullptr,
                                               rht_random_sign, as_stream(stream)),
               "activation_amaxes");
}

void activation_cast(const at::Tensor& h, int64_t activation, const std::optional<at::Tensor>& amax_rowwise,
                     const std::optional<at::Tensor>& amax_columnwise, const std::optional<at::Tensor>& rowwise_data,
                     const std::optional<at::Tensor>& rowwise_scale, const std::optional<at::Tensor>& columnwise_data,
                     const std::optional<at::Tensor>& columnwise_scale, bool row_scaled, bool rht, bool rht_random_sign,
                     const std::optional<at::Tensor>& table, int64_t stream) {
  const nvfp4::ActivationArgs args = activation_args(h, activation, table);
  check_launch(nvfp4::launch_activation_cast(args,
                                             producer_cast_args(args.rows, args.cols, amax_rowwise, amax_columnwise,
                                                                rowwise_data, rowwise_scale, columnwise_data,
                                                                columnwise_scale, row_scaled, rht, rht_random_sign),
                                             as_stream(stream)),
               "activation_cast");
}

// Peer-memory collectives: addresses (torch symmetric memory, valid in this process) as integers.
nvfp4::PeerGatherArgs peer_pieces(const std::vector<std::vector<int64_t>>& sources,
                                  const std::vector<int64_t>& destinations, const std::vector<int64_t>& rows,
                                  const std::vector<int64_t>& row_bytes, const std::vector<bool>& interleave) {
  const size_t count = destinations.size();
  TORCH_CHECK(count >= 1 && count <= nvfp4::kMaxPeerPieces && sources.size() == count && rows.size() == count &&
                  row_bytes.size() == count && interleave.size() == count,
              "nvfp4_dist._C: 1 to ", nvfp4::kMaxPeerPieces, " pieces, one entry each");
  nvfp4::PeerGatherArgs args{};
  args.count = static_cast<int>(count);
  args.world_size = static_cast<int>(sources[0].size());
  TORCH_CHECK(args.world_size >= 1 && args.world_size <= nvfp4::kMaxPeers, "nvfp4_dist._C: 1 to ", nvfp4::kMaxPeers,
              " ranks");
  for (size_t p = 0; p < count; ++p) {
    TORCH_CHECK(static_cast<int>(sources[p].size()) == args.world_size, "nvfp4_dist._C: one source per rank");
    for (int r = 0; r < args.world_size; ++r) args.pieces[p].src[r] = reinterpret_cast<const uint8_t*>(sources[p][r]);
    args.pieces[p].dst = reinterpret_cast<uint8_t*>(destinations[p]);
    args.pieces[p].rows = rows[p];
    args.pieces[p].row_bytes = row_bytes[p];
    args.pieces[p].interleave = interleave[p];
  }
  return args;
}

nvfp4::PeerBarrier peer_barrier(const std::vector<int64_t>& signal_pads, int64_t channel, int64_t rank,
                                int64_t blocks_done) {
  TORCH_CHECK(signal_pads.size() >= 1 && signal_pads.size() <= nvfp4::kMaxPeers && rank >= 0 &&
                  rank < static_cast<int64_t>(signal_pads.size()),
              "nvfp4_dist._C: 1 to ", nvfp4::kMaxPeers, " signal pads and a rank among them");
  nvfp4::PeerBarrier barrier{};
  for (size_t r = 0; r < signal_pads.size(); ++r) barrier.signal_pads[r] = reinterpret_cast<uint32_t*>(signal_pads[r]);
  barrier.channel = static_cast<int>(channel);
  barrier.rank = static_cast<int>(rank);
  barrier.world_size = static_cast<int>(signal_pads.size());
  barrier.blocks_done = reinterpret_cast<int*>(blocks_done);
  return barrier;
}

void peer_publish(const std::vector<int64_t>& sources, const std::vector<int64_t>& destinations,
                  const std::vector<int64_t>& nbytes, const std::vector<int64_t>& signal_pads, int64_t channel,
                  int64_t rank, int64_t blocks_done, int64_t stream) {
  std::vector<std::vector<int64_t>> single_sources;
  for (const int64_t source : sources) single_sources.push_back({source});
  const auto args = peer_pieces(single_sources, destinations, std::vector<int64_t>(sources.size(), 1), nbytes,
                                std::vector<bool>(sources.size(), false));
  check_launch(nvfp4::launch_peer_publish(args, peer_barrier(signal_pads, channel, rank, blocks_done), as_stream(stream)),
               "peer_publish");
}

void peer_gather(const std::vector<std::vector<int64_t>>& sources, const std::vector<int64_t>& destinations,
                 const std::vector<int64_t>& rows, const std::vector<int64_t>& row_bytes,
                 const std::vector<bool>& interleave, int64_t rank, int64_t stream) {
  check_launch(nvfp4::launch_peer_gather(peer_pieces(sources, destinations, rows, row_bytes, interleave),
                                         static_cast<int>(rank), as_stream(stream)),
               "peer_gather");
}

void peer_amax_all_reduce(const std::vector<int64_t>& values, const std::vector<int64_t>& slots,
                          const std::vector<int64_t>& signal_pads, int64_t channel, int64_t rank, int64_t stream) {
  TORCH_CHECK(values.size() >= 1 && values.size() <= nvfp4::kMaxPeerAmaxes && slots.size() == signal_pads.size(),
              "nvfp4_dist._C: 1 to ", nvfp4::kMaxPeerAmaxes, " amaxes and one slot per rank");
  nvfp4::PeerAmaxArgs args{};
  args.count = static_cast<int>(values.size());
  for (size_t i = 0; i < values.size(); ++i) args.values[i] = reinterpret_cast<float*>(values[i]);
  for (size_t r = 0; r < slots.size(); ++r) args.slots[r] = reinterpret_cast<float*>(slots[r]);
  check_launch(nvfp4::launch_peer_amax_all_reduce(args, peer_barrier(signal_pads, channel, rank, 0), as_stream(stream)),
               "peer_amax_all_reduce");
}

void peer_barrier_only(const std::vector<int64_t>& signal_pads, int64_t channel, int64_t rank, int64_t stream) {
  check_launch(nvfp4::launch_peer_barrier(peer_barrier(signal_pads, channel, rank, 0), as_stream(stream)),
               "peer_barrier");
}

// The layers' hot path (nvfp4_dist/hot_path.py): one call for a whole quantize (amaxes, outputs, cast) and one for
// a whole emulated GEMM, composed of the launchers above in the order nvfp4_dist/kernels.py and
// nvfp4_dist/gemm/hopper.py run them (so the same bytes), for a layer's forward+backward to cost a handful of
// calls of host time instead of dozens.

// kernels.quantize_tensor without 4over6: the amaxes of the copies asked for and not given (as
// kernels.compute_amaxes takes them), the copies' outputs, the cast. Returns [rowwise data, rowwise scale (E4M3),
// rowwise amax, columnwise data, columnwise scale, columnwise amax], undefined (None) for a copy not asked for.
std::vector<at::Tensor> quantize_copies(const at::Tensor& input, bool rowwise, bool columnwise, bool block_2d,
                                        bool rht, bool rht_random_sign, bool row_scaled,
                                        const std::optional<at::Tensor>& given_rowwise,
                                        const std::optional<at::Tensor>& given_columnwise, bool stochastic_rounding,
                                        int64_t sr_seed, const std::optional<at::Tensor>& sr_seed_device,
                                        int64_t sr_row_offset, int64_t stream) {
  TORCH_CHECK(input.dim() == 2 && (rowwise || columnwise), "nvfp4_dist._C.quantize_copies: 2D x and a copy to make");
  at::Tensor x = input.contiguous();
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) x = x.clone();  // the kernels read 16-byte vectors
  const int64_t rows = x.size(0), cols = x.size(1);
  const auto floats = x.options().dtype(at::kFloat);
  at::Tensor amax_row, amax_col;
  if (rowwise && given_rowwise.has_value()) {
    amax_row = given_rowwise->reshape({-1}).contiguous();
    TORCH_CHECK(amax_row.scalar_type() == at::kFloat && amax_row.numel() == (row_scaled ? rows : 1),
                "nvfp4_dist._C.quantize_copies: the given rowwise amax has the wrong dtype or size");
  }
  if (columnwise && given_columnwise.has_value()) {
    amax_col = given_columnwise->reshape({-1}).contiguous();
    TORCH_CHECK(amax_col.scalar_type() == at::kFloat && amax_col.numel() == (row_scaled ? cols : 1),
                "nvfp4_dist._C.quantize_copies: the given columnwise amax has the wrong dtype or size");
  }
  const bool need_row = rowwise && !amax_row.defined();
  const bool need_col = columnwise && !amax_col.defined();
  if (need_row && row_scaled) {
    amax_row = at::empty({rows}, floats);
    amax_rows(x, amax_row, stream);
  }
  if (need_col && row_scaled) {
    amax_col = at::empty({cols}, floats);
    amax_columns(x, rht, rht_random_sign, amax_col, stream);
  } else if (need_col && rht) {
    amax_col = at::empty({1}, floats);
    std::optional<at::Tensor> plain;
    if (need_row && !row_scaled) plain = at::empty({1}, floats);
    amax_rht(x, rht_random_sign, plain, amax_col, stream);
    if (plain.has_value()) amax_row = *plain;
  }
  const bool row_missing = need_row && !amax_row.defined();
  const bool col_missing = need_col && !amax_col.defined();
  if (row_missing || col_missing) {
    at::Tensor amax = at::empty({1}, floats);
    amax_tensor(x, amax, stream);
    if (row_missing) amax_row = amax;
    if (col_missing) amax_col = row_missing ? amax.clone() : amax;
  }
  const auto codes = x.options().dtype(at::kByte);
  const auto scales = x.options().dtype(at::kFloat8_e4m3fn);
  at::Tensor row_data, row_scale, col_data, col_scale;
  std::optional<at::Tensor> row_data_arg, row_scale_arg, row_amax_arg, col_data_arg, col_scale_arg, col_amax_arg;
  if (rowwise) {
    row_data = at::empty({rows, cols / 2}, codes);
    row_scale = at::empty({rows, cols / 16}, scales);
    row_data_arg = row_data;
    row_scale_arg = row_scale.view(at::kByte);
    row_amax_arg = amax_row;
  }
  if (columnwise) {
    col_data = at::empty({cols, rows / 2}, codes);
    col_scale = at::empty({cols, rows / 16}, scales);
    col_data_arg = col_data;
    col_scale_arg = col_scale.view(at::kByte);
    col_amax_arg = amax_col;
  }
  quantize(x, row_amax_arg, col_amax_arg, row_data_arg, row_scale_arg, col_data_arg, col_scale_arg, row_scaled,
           block_2d, rht, rht_random_sign, stochastic_rounding, sr_seed, sr_seed_device, sr_row_offset, false, 448,
           false, false, stream);
  return {row_data, row_scale, amax_row, col_data, col_scale, amax_col};
}

// gemm_dequantize_matmul's common case: per-tensor amaxes, A in one chunk of max_chunk_bytes, alpha (and a bias of
// the output's dtype) applied by cuBLASLt.
bool emulated_gemm_applies(const at::Tensor& a_data, const at::Tensor& a_amax, const at::Tensor& b_amax,
                           const std::optional<at::Tensor>& bias, bool accumulate, at::ScalarType out_type,
                           int64_t max_chunk_bytes) {
  const int64_t rows = a_data.size(0), k = 2 * a_data.size(1);
  const int64_t chunk_rows = std::max<int64_t>(256, max_chunk_bytes / (4 * k) / 256 * 256);  // as hopper.py chunks
  return a_amax.numel() == 1 && b_amax.numel() == 1 && rows > 0 && rows <= chunk_rows &&
         !(bias.has_value() && (accumulate || bias->scalar_type() != out_type));
}

// The common case's kernels into out (= or +=): A's block values into a BF16 buffer, B's too unless given
// (b_values: B's block values, BF16 [N, K]), then cuBLASLt multiplies them. False when cuBLASLt has no algorithm
// (the dequantizations launched, nothing written to out).
bool emulated_gemm_into(const at::Tensor& a_data, const at::Tensor& a_scale, const at::Tensor& a_amax,
                        const at::Tensor& b_data, const at::Tensor& b_scale,
                        const std::optional<at::Tensor>& b_values_given, const at::Tensor& b_amax,
                        const std::optional<at::Tensor>& bias, bool accumulate, int64_t a_e4m3_bound,
                        int64_t b_e4m3_bound, at::Tensor& out, int64_t stream) {
  const int64_t rows = a_data.size(0), k = 2 * a_data.size(1), cols = b_data.size(0);
  at::Tensor a_values = at::empty({rows, k}, a_data.options().dtype(at::kBFloat16));
  dequantize_block_values(a_data.contiguous(), a_scale.contiguous().view(at::kByte), 1.0, a_values, stream);
  at::Tensor b_values;
  if (b_values_given.has_value()) {
    b_values = *b_values_given;
  } else {
    b_values = at::empty({cols, k}, a_data.options().dtype(at::kBFloat16));
    dequantize_block_values(b_data.contiguous(), b_scale.contiguous().view(at::kByte), 1.0, b_values, stream);
  }
  std::optional<at::Tensor> bias_arg;
  if (bias.has_value()) bias_arg = bias->contiguous();
  return cublaslt_gemm(a_values, b_values, a_amax.contiguous(), b_amax.contiguous(), bias_arg, accumulate,
                       a_e4m3_bound, b_e4m3_bound, out, stream);
}

// The common case in one call. out_dtype: 0 BF16, 1 FP32, 2 FP16. Returns y (accumulate_into when given, after
// adding y into it), or an undefined tensor (None), having launched nothing, for any other case: the caller's
// general path takes it.
at::Tensor emulated_gemm(const at::Tensor& a_data, const at::Tensor& a_scale, const at::Tensor& a_amax,
                         const at::Tensor& b_data, const at::Tensor& b_scale,
                         const std::optional<at::Tensor>& b_values_given, const at::Tensor& b_amax,
                         const std::optional<at::Tensor>& bias,
                         int64_t out_dtype, const std::optional<at::Tensor>& accumulate_into, int64_t a_e4m3_bound,
                         int64_t b_e4m3_bound, int64_t max_chunk_bytes, int64_t stream) {
  constexpr at::ScalarType kOutTypes[] = {at::kBFloat16, at::kFloat, at::kHalf};
  TORCH_CHECK(out_dtype >= 0 && out_dtype < 3, "nvfp4_dist._C.emulated_gemm: out_dtype is 0, 1 or 2");
  const bool accumulate = accumulate_into.has_value();
  const at::ScalarType out_type = accumulate ? accumulate_into->scalar_type() : kOutTypes[out_dtype];
  if (!emulated_gemm_applies(a_data, a_amax, b_amax, bias, accumulate, out_type, max_chunk_bytes)) {
    return at::Tensor();
  }
  at::Tensor out = accumulate ? *accumulate_into
                              : at::empty({a_data.size(0), b_data.size(0)}, a_data.options().dtype(out_type));
  if (!emulated_gemm_into(a_data, a_scale, a_amax, b_data, b_scale, b_values_given, b_amax, bias, accumulate,
                          a_e4m3_bound, b_e4m3_bound, out, stream)) {
    return at::Tensor();
  }
  return out;
}

// Whether `next` continues `previous` row for row in one buffer (as the grouped quantization lays out the experts'
// rowwise copies and the stacked weights' copies): both contiguous, same width, next's first byte right after
// previous's last.
bool rows_follow(const at::Tensor& previous, const at::Tensor& next) {
  return previous.is_contiguous() && next.is_contiguous() && previous.dim() == 2 && next.dim() == 2 &&
         previous.size(1) == next.size(1) && previous.scalar_type() == next.scalar_type() &&
         previous.storage().is_alias_of(next.storage()) &&
         static_cast<const char*>(previous.data_ptr()) + previous.nbytes() == static_cast<const char*>(next.data_ptr());
}

// The BF16 block values of each operand (data [rows, K/2], scale [rows, K/16]): operands whose data and scales
// continue each other row for row (rows_follow) are dequantized by one launch into one buffer and handed out as
// its row slices, each starting on a 256-byte boundary (cuBLASLt's default operand alignment); any other operand
// by a launch of its own.
std::vector<at::Tensor> block_values(const std::vector<at::Tensor>& data, const std::vector<at::Tensor>& scale,
                                     int64_t stream) {
  std::vector<at::Tensor> values(data.size());
  size_t first = 0;
  while (first < data.size()) {
    const int64_t k = 2 * data[first].size(1);
    int64_t rows = data[first].size(0);
    size_t end = first + 1;
    while (end < data.size() && rows_follow(data[end - 1], data[end]) && rows_follow(scale[end - 1], scale[end]) &&
           (rows * k * 2) % 256 == 0) {
      rows += data[end].size(0);
      ++end;
    }
    at::Tensor run_data = data[first].contiguous(), run_scale = scale[first].contiguous();
    if (end - first > 1) {
      run_data = data[first].as_strided({rows, data[first].size(1)}, {data[first].size(1), 1});
      run_scale = scale[first].as_strided({rows, scale[first].size(1)}, {scale[first].size(1), 1});
    }
    at::Tensor run_values = at::empty({rows, k}, data[first].options().dtype(at::kBFloat16));
    dequantize_block_values(run_data, run_scale.view(at::kByte), 1.0, run_values, stream);
    int64_t offset = 0;
    for (size_t e = first; e < end; ++e) {
      values[e] = run_values.narrow(0, offset, data[e].size(0));
      offset += data[e].size(0);
    }
    first = end;
  }
  return values;
}

// A grouped layer's GEMM stage (nvfp4_dist/grouped_linear.py): for every expert e, outs[e] = A_e . B_e^T (+ bias e)
// or += it, each by the kernels emulated_gemm runs (the same dequantization, cuBLASLt with the same problem and
// operand layouts: the same bytes as a loop of it), in one call; the operands that follow each other row for row
// are dequantized together (block_values), and one workspace serves every GEMM. outs[e]: the expert's output (rows
// of one output tensor, or its weight gradient), unit column stride. biases: empty, or one per expert. Returns the
// experts done: all of them, or none (nothing launched) when one falls outside the common case or an output is not
// on a 256-byte boundary; cuBLASLt having no algorithm for expert e stops there (experts before e done), the
// caller runs the rest.
int64_t grouped_emulated_gemm(const std::vector<at::Tensor>& a_data, const std::vector<at::Tensor>& a_scale,
                              const std::vector<at::Tensor>& a_amax, const std::vector<at::Tensor>& b_data,
                              const std::vector<at::Tensor>& b_scale, const std::vector<at::Tensor>& b_amax,
                              const std::vector<at::Tensor>& biases, std::vector<at::Tensor> outs, bool accumulate,
                              int64_t a_e4m3_bound, int64_t b_e4m3_bound, int64_t max_chunk_bytes, int64_t stream) {
  const size_t experts = a_data.size();
  TORCH_CHECK(a_scale.size() == experts && a_amax.size() == experts && b_data.size() == experts &&
                  b_scale.size() == experts && b_amax.size() == experts && outs.size() == experts &&
                  (biases.empty() || biases.size() == experts),
              "nvfp4_dist._C.grouped_emulated_gemm: one operand pair and one output per expert");
  if (experts == 0) return 0;
  auto bias_of = [&](size_t e) -> std::optional<at::Tensor> {
    if (biases.empty()) return std::nullopt;
    return biases[e].contiguous();
  };
  for (size_t e = 0; e < experts; ++e) {
    TORCH_CHECK(outs[e].dim() == 2 && outs[e].size(0) == a_data[e].size(0) && outs[e].size(1) == b_data[e].size(0) &&
                    a_data[e].size(1) == b_data[e].size(1),
                "nvfp4_dist._C.grouped_emulated_gemm: A_e [M, K/2], B_e [N, K/2] and outs[e] [M, N]");
    if (!emulated_gemm_applies(a_data[e], a_amax[e], b_amax[e], bias_of(e), accumulate, outs[e].scalar_type(),
                               max_chunk_bytes) ||
        outs[e].stride(1) != 1 || reinterpret_cast<uintptr_t>(outs[e].data_ptr()) % 256 != 0) {
      return 0;
    }
  }
  const std::vector<at::Tensor> a_values = block_values(a_data, a_scale, stream);
  const std::vector<at::Tensor> b_values = block_values(b_data, b_scale, stream);
  // Every expert's (alpha, beta) in one launch (per 64 experts), then one cuBLASLt call each.
  std::vector<at::Tensor> a_amaxes(experts), b_amaxes(experts);
  std::vector<const float*> a_pointers(experts), b_pointers(experts);
  for (size_t e = 0; e < experts; ++e) {
    a_amaxes[e] = a_amax[e].contiguous();
    b_amaxes[e] = b_amax[e].contiguous();
    check_device_tensor(a_amaxes[e], "a_amax");
    check_device_tensor(b_amaxes[e], "b_amax");
    a_pointers[e] = a_amaxes[e].data_ptr<float>();
    b_pointers[e] = b_amaxes[e].data_ptr<float>();
  }
  at::Tensor scalars = at::empty({static_cast<int64_t>(2 * experts)}, a_amax[0].options());
  check_launch(nvfp4::launch_gemm_scalars(a_pointers.data(), b_pointers.data(), static_cast<int64_t>(experts),
                                          static_cast<int>(a_e4m3_bound), static_cast<int>(b_e4m3_bound), accumulate,
                                          scalars.data_ptr<float>(), as_stream(stream)),
               "gemm_scalars");
  at::Tensor workspace = at::empty({kCublasWorkspaceBytes}, a_data[0].options().dtype(at::kByte));
  for (size_t e = 0; e < experts; ++e) {
    if (!cublaslt_gemm_using(a_values[e], b_values[e], a_amaxes[e], b_amaxes[e], bias_of(e), accumulate,
                             a_e4m3_bound, b_e4m3_bound, outs[e], scalars.data_ptr<float>() + 2 * e, true, workspace,
                             stream)) {
      return static_cast<int64_t>(e);
    }
  }
  return static_cast<int64_t>(experts);
}

// The cuBLASLt FP4 path's block scales (nvfp4_dist/hot_path.py): A's and B's E4M3 scales [rows, K/16], each
// swizzled into a new flat buffer of the 128x4 layout, zero padded (swizzle_scales), in one call.
std::vector<at::Tensor> swizzled_scale_pair(const at::Tensor& a_scale, const at::Tensor& b_scale, int64_t stream) {
  std::vector<at::Tensor> swizzled;
  for (const at::Tensor* scale : {&a_scale, &b_scale}) {
    TORCH_CHECK(scale->dim() == 2 && scale->element_size() == 1,
                "nvfp4_dist._C.swizzled_scale_pair: 2D scales of 1-byte elements");
    at::Tensor out = at::empty({swizzled_scale_bytes(*scale)}, scale->options().dtype(at::kByte));
    swizzle_scales(scale->view(at::kByte), out, stream);
    swizzled.push_back(out.view(at::kFloat8_e4m3fn));
  }
  return swizzled;
}

// The cuBLASLt FP4 path's output (nvfp4_dist/hot_path.py): raw is cuBLASLt's FP32 A . B^T without the global
// scales; gemm_epilogue writes raw * S_dec(a) * S_dec(b) (+ bias) into target (added into it when accumulate), or
// into a new tensor of out_dtype (0 BF16, 1 FP32, 2 FP16) when no target is given. Returns what it wrote.
at::Tensor scaled_mm_output(const at::Tensor& raw, const at::Tensor& a_amax, const at::Tensor& b_amax,
                            const std::optional<at::Tensor>& bias, int64_t out_dtype,
                            const std::optional<at::Tensor>& target, bool accumulate, int64_t a_e4m3_bound,
                            int64_t b_e4m3_bound, int64_t stream) {
  constexpr at::ScalarType kOutTypes[] = {at::kBFloat16, at::kFloat, at::kHalf};
  TORCH_CHECK(out_dtype >= 0 && out_dtype < 3, "nvfp4_dist._C.scaled_mm_output: out_dtype is 0, 1 or 2");
  TORCH_CHECK(target.has_value() || !accumulate, "nvfp4_dist._C.scaled_mm_output: accumulate needs a target");
  at::Tensor out = target.has_value() ? *target : at::empty(raw.sizes(), raw.options().dtype(kOutTypes[out_dtype]));
  std::optional<at::Tensor> bias_arg;
  if (bias.has_value()) bias_arg = bias->contiguous();
  gemm_epilogue(raw, a_amax.contiguous(), b_amax.contiguous(), bias_arg, accumulate, a_e4m3_bound, b_e4m3_bound, out,
                stream);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "NVFP4 quantization kernels of nvfp4_dist (see nvfp4_dist/kernels.py)";
  m.def("quantize_copies", &quantize_copies, "amaxes, outputs and cast of a quantize in one call (hot path)");
  m.def("emulated_gemm", &emulated_gemm, "dequantize A, then cuBLASLt with alpha from the amaxes, in one call (hot path)");
  m.def("grouped_emulated_gemm", &grouped_emulated_gemm, "every expert's emulated_gemm into its output, in one call");
  m.def("swizzled_scale_pair", &swizzled_scale_pair,
        "A's and B's block scales in the 128x4 layout (cuBLASLt FP4)");
  m.def("scaled_mm_output", &scaled_mm_output, "cuBLASLt FP4's FP32 product times alpha (+ bias), into the output");
  m.def("amax_tensor", &amax_tensor, "max |x| into amax (1,)");
  m.def("amax_rows", &amax_rows, "max |x| of each row into amax (rows,)");
  m.def("amax_rht", &amax_rht, "plain and post-RHT amax of a BF16 tensor");
  m.def("amax_columns", &amax_columns, "max |x| of each column (after the RHT of its 16-row chunks) into amax (cols,)");
  m.def("quantize", &quantize, "NVFP4 cast writing the rowwise and/or columnwise copy");
  m.def("quantize_segmented", &quantize_segmented, "NVFP4 cast with per-row / per-16-row-chunk amaxes (segments)");
  m.def("amax_rht_chunks", &amax_rht_chunks, "plain and post-RHT amax of each 16-row chunk of a BF16 tensor");
  m.def("segment_amaxes", &segment_amaxes, "per-segment maxima of per-row or per-chunk amaxes, expanded");
  m.def("record_check", &record_check, "fold a NaN/Inf check's values into a pinned host record");
  m.def("dequantize_rowwise", &dequantize_rowwise, "rowwise copy back to out's dtype");
  m.def("dequantize_block_values", &dequantize_block_values, "fp4 value * block scale * factor, no global scale");
  m.def("cublaslt_gemm", &cublaslt_gemm, "alpha * A . B^T (+ bias) or += it, alpha from the amaxes on the device");
  m.def("gemm_epilogue", &gemm_epilogue, "out (+)= acc * S_dec(a) * S_dec(b) (+ bias), FP32, one rounding");
  m.def("dequantize_columnwise", &dequantize_columnwise, "columnwise copy back to out's dtype, [rows, cols]");
  m.def("swizzle_scales", &swizzle_scales, "128x4 swizzled scales, zero padded");
  m.def("swap_first_dims", &swap_first_dims, "(W, K, X) -> (K, W, X)");
  m.def("transpose_codes", &transpose_codes, "packed FP4 codes [N, K/2] -> those of the transpose, [K, N/2]");
  m.def("norm_rows", &norm_rows,
        "norm statistics (and the sums of squares before rstd), and its output and the amaxes of its NVFP4 copies "
        "when asked");
  m.def("norm_cast", &norm_cast, "NVFP4 copies of a norm's BF16 output from its statistics, the output not written");
  m.def("activation_forward", &activation_forward, "GELU / SwiGLU of fc1's output");
  m.def("activation_amaxes", &activation_amaxes, "amaxes of the NVFP4 copies of an activation's BF16 output");
  m.def("activation_cast", &activation_cast, "NVFP4 copies of an activation's BF16 output, the output not written");
  m.def("activation_table", &activation_table, "the table by which the activation kernels activate BF16 inputs");
  m.def("activation_table_bytes", &activation_table_bytes, "the size of activation_table's output");
  m.def("peer_publish", &peer_publish, "this rank's pieces into its symmetric buffer, then a barrier over the ranks");
  m.def("peer_gather", &peer_gather, "every rank's published pieces into outputs, concatenated or interleaved");
  m.def("peer_barrier", &peer_barrier_only, "a barrier over the ranks' signal pads, on the stream");
  m.def("peer_amax_all_reduce", &peer_amax_all_reduce, "MAX over ranks of a few FP32 values, in place");
}
