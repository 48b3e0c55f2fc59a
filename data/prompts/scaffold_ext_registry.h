// The op registry of the extension: each kernels/NAME_binding.cpp adds a function that defines its ops on the
// module, and binding.cpp calls them all from PYBIND11_MODULE(cuda_extension, m).
#pragma once
#include <torch/extension.h>

#include <vector>

namespace cuda_extension_registry {
using BindFn = void (*)(pybind11::module&);

inline std::vector<BindFn>& bindings() {
    static std::vector<BindFn> fns;  // built on first use: safe across translation units at load time
    return fns;
}

struct Registrar {
    explicit Registrar(BindFn fn) { bindings().push_back(fn); }
};
}  // namespace cuda_extension_registry

#define REGISTER_BINDING(NAME, FN) static cuda_extension_registry::Registrar registrar_##NAME(FN)
