// Torch binding of sparse_attention_pair.cu: checks the tensors and launches on the current stream.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

extern "C" int fidelity_fp8kv_pair_launch(const void* q, const void* kv, const void* idx, const void* sink, void* o,
                                          int n, int heads, int topk, int64_t q_sn, int64_t q_sh, int64_t idx_sn,
                                          int64_t o_sn, int64_t o_sh, float scale, int parts,
                                          cudaStream_t stream);

// q bf16 [n, H, 512], kv uint8 [m, 584], idx int32 [n, topk], sink fp32 [H] -> o bf16 [n, H, 512]; parts: the
// kernel's PART_* bits (7: all; fewer only for the diagnosis)
torch::Tensor forward(torch::Tensor q, torch::Tensor kv, torch::Tensor idx, torch::Tensor sink, double scale,
                      int64_t parts) {
    TORCH_CHECK(q.is_cuda() && q.scalar_type() == torch::kBFloat16 && q.dim() == 3 && q.size(2) == 512,
                "q: bf16 [n, H, 512] on CUDA");
    TORCH_CHECK(q.stride(2) == 1 && q.stride(1) % 8 == 0 && q.stride(0) % 8 == 0, "q: 16-byte aligned rows");
    TORCH_CHECK(q.size(1) % 64 == 0, "q: a multiple of 64 heads");
    TORCH_CHECK(kv.scalar_type() == torch::kUInt8 && kv.dim() == 2 && kv.size(1) == 584 && kv.is_contiguous(),
                "kv: contiguous uint8 [m, 584]");
    TORCH_CHECK(idx.scalar_type() == torch::kInt32 && idx.dim() == 2 && idx.size(0) == q.size(0) &&
                (idx.size(1) == 0 || idx.stride(1) == 1), "idx: int32 [n, topk], last dim contiguous");
    TORCH_CHECK(sink.scalar_type() == torch::kFloat32 && sink.is_contiguous() && sink.numel() == q.size(1),
                "sink: contiguous fp32 [H]");
    TORCH_CHECK(kv.device() == q.device() && idx.device() == q.device() && sink.device() == q.device(),
                "all tensors on one device");
    const at::cuda::CUDAGuard guard(q.device());
    auto o = torch::empty({q.size(0), q.size(1), 512}, q.options());
    if (q.size(0) == 0) return o;
    const int err = fidelity_fp8kv_pair_launch(
        q.data_ptr(), kv.data_ptr(), idx.data_ptr(), sink.data_ptr(), o.data_ptr(), static_cast<int>(q.size(0)),
        static_cast<int>(q.size(1)), static_cast<int>(idx.size(1)), q.stride(0), q.stride(1), idx.stride(0),
        o.stride(0), o.stride(1), static_cast<float>(scale), static_cast<int>(parts),
        at::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == 0, "sparse_attention_pair launch: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
    return o;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &forward, "sparse decode attention on the 584 B FP8 KV layout, CTA pairs");
}
