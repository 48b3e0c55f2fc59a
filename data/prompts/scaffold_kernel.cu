// Plain CUDA C++ (nvcc -O3). Export launchers with extern "C"; no torch headers. cuBLAS is linked.
#include <cuda_runtime.h>

__global__ void my_op_kernel(const float* x, float* y, long n) {
    // TODO
}

extern "C" void my_op(const float* x, float* y, long n, void* stream) {
    // TODO: launch on (cudaStream_t)stream
}
