// The sandbox's dispatch guard (layer 1 of the no-torch rule), in C++ so that a checked call costs what an
// unchecked one does: ~1 us per call instead of a Python TorchDispatchMode's ~25 us, which on a launch-bound
// kernel (a 4096^2 ReLU runs 35 us on an H200) was most of the measured time.
//
// A boxed fallback on a dispatch key that nothing else in torch uses, TESTING_ONLY_GenericMode. It sits above
// autograd and every backend key, so while the key is in the thread's included set, every operator that goes
// through the dispatcher comes here first: from Python, from a C++ extension (`at::relu`, `x.sum()`), and
// each op a composite op calls in turn. An aten or prims op whose name is outside the allow-list of the
// current mode is recorded and refused; any other op is passed on below this key unchanged.
//
// The ops that every mode allows (allocation, views, metadata) get a fallthrough kernel on the key instead
// (`sandbox_guard_seal`): the dispatcher skips the key for them at no cost, where the boxed fallback cost an
// honest `torch.empty_like` two boxed trips (~7 us on an H200, empty_like and the empty_strided it calls).
// Nothing is lost: the key stays in the thread's set, so each op such an op calls in turn is still seen.
//
// Covers: every dispatched op on the calling thread (and on torch's intra-op threads, which inherit the
// thread-local key set). Does not cover: a thread of the candidate's own (the worker checks for new threads),
// native code that calls a kernel without the dispatcher (`at::native::...`) or clears the key itself; the
// static scan refuses the names for that, and native code can in any case do anything in its process.
//
// Built by sandbox.build.guard_library against the running torch's headers; loaded by sandbox_worker through
// ctypes before any candidate code, at HARNESS_DIR/sandbox_guard.so when the repository is hidden.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>

namespace {

constexpr auto kKey = c10::DispatchKey::TESTING_ONLY_GenericMode;
constexpr int kModes = 2;  // 0: a forward (allocation, views, metadata); 1: import and __init__ (+ creation)

std::unordered_set<std::string> g_allowed[kModes];  // op names without namespace or overload
int g_mode = 0;
std::mutex g_mu;
std::string g_bad;  // the first refused op since the guard was last switched on
std::unique_ptr<torch::Library> g_fast;  // the fallthrough registrations (kept alive: dropping them deregisters)

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const std::string& name = op.operator_name().name;  // "aten::relu"
  const size_t ns = name.compare(0, 6, "aten::") == 0 ? 6 : name.compare(0, 7, "prims::") == 0 ? 7 : 0;
  if (ns && !g_allowed[g_mode].count(name.substr(ns))) {
    {
      std::lock_guard<std::mutex> lock(g_mu);
      if (g_bad.empty()) g_bad = name;
    }
    TORCH_CHECK(false, "sandbox: aten op ", name, " is not allowed here");
  }
  // Everything above this key is dropped along with it, as every fallback does (FULL_AFTER).
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

extern "C" {

// Adds `name` (e.g. "empty_like") to the allow-list of `mode`. Called before any candidate code runs.
void sandbox_guard_allow(int mode, const char* name) {
  if (mode >= 0 && mode < kModes) g_allowed[mode].insert(name);
}

// Registers a fallthrough on the key for every overload of every aten op allowed in all modes; called once,
// after the allow-lists are complete and before any candidate code. Returns the number of overloads.
int sandbox_guard_seal() {
  if (g_fast) return 0;
  g_fast = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", kKey, __FILE__, __LINE__);
  int n = 0;
  for (const auto& op : c10::Dispatcher::singleton().getAllOpNames()) {
    if (op.name.compare(0, 6, "aten::") != 0) continue;
    const std::string base = op.name.substr(6);
    bool everywhere = true;
    for (const auto& allowed : g_allowed) everywhere = everywhere && allowed.count(base);
    if (!everywhere) continue;
    const std::string full = op.overload_name.empty() ? base : base + "." + op.overload_name;
    g_fast->impl(full.c_str(), torch::CppFunction::makeFallthrough());
    ++n;
  }
  return n;
}

// Switches the guard on for this thread, in `mode`, with no op recorded.
void sandbox_guard_on(int mode) {
  g_mode = (mode >= 0 && mode < kModes) ? mode : 0;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_bad.clear();
  }
  c10::impl::tls_set_dispatch_key_included(kKey, true);
}

// Switches the guard off for this thread; writes the first refused op (empty if none) into buf.
int sandbox_guard_off(char* buf, int n) {
  c10::impl::tls_set_dispatch_key_included(kKey, false);
  std::lock_guard<std::mutex> lock(g_mu);
  std::snprintf(buf, n, "%s", g_bad.c_str());
  return static_cast<int>(g_bad.size());
}

}  // extern "C"
