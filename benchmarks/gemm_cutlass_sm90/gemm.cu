// Scratch probe: one CUTLASS 3 sm90 GEMM configuration, D[M,N] = A[M,K] @ W[N,K]^T (bf16, fp32 acc),
// exported through a C function so Python loads it with ctypes (no torch ABI).
#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
#ifndef TM
#define TM 128
#define TN 256
#define TK 64
#define CM 1
#define CN 1
#define SCHED 0
#define TSCHED 0
#endif

using EA = cutlass::bfloat16_t;
using LA = cutlass::layout::RowMajor;
using LB = cutlass::layout::ColumnMajor;
using LC = cutlass::layout::RowMajor;
using TileMNK = Shape<Int<TM>, Int<TN>, Int<TK>>;
using ClusterMNK = Shape<Int<CM>, Int<CN>, _1>;
#if SCHED == 0
using KSched = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using ESched = cutlass::epilogue::TmaWarpSpecializedCooperative;
#else
using KSched = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using ESched = cutlass::epilogue::TmaWarpSpecialized;
#endif
#if TSCHED == 0
using TSch = cutlass::gemm::PersistentScheduler;
#else
using TSch = cutlass::gemm::StreamKScheduler;
#endif

using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileMNK, ClusterMNK,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    EA, LC, 8, EA, LC, 8, ESched>::CollectiveOp;
using Main = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, EA, LA, 8, EA, LB, 8, float, TileMNK, ClusterMNK,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
    KSched>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi, TSch>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

static typename Gemm::Arguments make_args(int M, int N, int K, const void* A, const void* B, void* D) {
  static int sms = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = sms;
  auto sA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, cute::make_shape(M, K, 1));
  auto sB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, cute::make_shape(N, K, 1));
  auto sC = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, cute::make_shape(M, N, 1));
  auto sD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, cute::make_shape(M, N, 1));
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {M, N, K, 1},
                                {static_cast<const EA*>(A), sA, static_cast<const EA*>(B), sB},
                                {{}, static_cast<const EA*>(D), sC, static_cast<EA*>(D), sD},
                                hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

extern "C" size_t lp_workspace(int M, int N, int K) {
  auto args = make_args(M, N, K, nullptr, nullptr, nullptr);
  return Gemm::get_workspace_size(args);
}

extern "C" int lp_gemm(int M, int N, int K, const void* A, const void* B, void* D, void* ws,
                       size_t ws_bytes, void* stream) {
  auto args = make_args(M, N, K, A, B, D);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (Gemm::get_workspace_size(args) > ws_bytes) return 2;
  auto s = static_cast<cudaStream_t>(stream);
  if (gemm.initialize(args, ws, s) != cutlass::Status::kSuccess) return 3;
  if (gemm.run(s) != cutlass::Status::kSuccess) return 4;
  return 0;
}
