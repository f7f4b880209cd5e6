// noop_kernels.cpp: a kernel "emulation library" for the fake CUDA driver (tests/fakecuda/driver/) whose
// kernels do nothing, so that bench/c_runtime_bench.py measures the runtimes' host time per call and not the CPU
// emulation of the kernels. One entry per catalogue symbol (sdk/catalog.py, KERNELS), of every compiled shape's
// kernels (libcolibri looks up every shape's symbols at init).
#define NOOP(name) \
    extern "C" __attribute__((visibility("default"))) int coli_emu_launch_##name(const unsigned*, const unsigned*, void**) { return 0; }
NOOP(colibri_routing)
NOOP(colibri_align)
NOOP(colibri_gate_up)
NOOP(colibri_down)
NOOP(colibri_aggregate)
NOOP(colibri_gate_up_gemv)
NOOP(colibri_down_gemv)
NOOP(colibri_gate_up_tc)
NOOP(colibri_down_tc)
NOOP(colibri_gate_up_qtc)
NOOP(colibri_down_qtc)
NOOP(colibri_shared_gate_up)
NOOP(colibri_shared_down)
NOOP(colibri_capacity)
extern "C" __attribute__((visibility("default"))) const char* coli_emu_error() { return ""; }
