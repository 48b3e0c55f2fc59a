// Registers {name}_forward (kernels/{name}.{ext}) as an op of the cuda_extension module.
#include <torch/extension.h>

#include "../binding_registry.h"

torch::Tensor {name}_forward(torch::Tensor x);

static void bind_{name}(pybind11::module& m) {
    m.def("{name}_forward", &{name}_forward, "TODO: what it computes");
}

REGISTER_BINDING({name}, bind_{name});
