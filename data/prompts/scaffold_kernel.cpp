// Plain C++ with OpenMP (g++ -O3 -fopenmp). Export launchers with extern "C"; no torch headers.
#include <cstdint>

extern "C" void my_op(const float* x, float* y, long n, void* stream) {
    // TODO
}
