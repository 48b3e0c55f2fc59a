// The one Python module of the workspace: every op registered by a kernels/*_binding.cpp.
#include <torch/extension.h>

#include "binding_registry.h"

PYBIND11_MODULE(cuda_extension, m) {
    for (auto fn : cuda_extension_registry::bindings()) fn(m);
}
