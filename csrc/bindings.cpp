// The one binding file: converts between torch/Python and ringdp's torch-free C++ API.
// No logic lives here beyond argument conversion.
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <chrono>
#include <csignal>

#include "common/endpoint.h"
#include "common/error.h"
#include "common/interrupt.h"
#include "common/types.h"
#include "kernels/cpu/reduce.h"
#include "ring/ring.h"
#include "ring/schedule.h"
#include "ring/trace.h"
#include "transport/shm/names.h"
#include "transport/shm/shm_comm.h"
#ifdef RINGDP_WITH_CUDA
#include "cuda/cuda_api.h"
#endif

namespace py = pybind11;
using namespace ringdp;

namespace {

// The one dtype table: the torch dtypes ringdp reduces and their codes (types.h DType).
// Python asks for the list (supported_dtypes) instead of keeping its own.
struct DTypeEntry {
  at::ScalarType scalar;
  DType dtype;
};
constexpr DTypeEntry kDTypes[] = {
    {at::kFloat, DType::kFloat32}, {at::kDouble, DType::kFloat64}, {at::kHalf, DType::kFloat16},
    {at::kBFloat16, DType::kBFloat16}, {at::kInt, DType::kInt32}, {at::kLong, DType::kInt64},
};

DType to_dtype(at::ScalarType t) {
  for (const auto& e : kDTypes)
    if (e.scalar == t) return e.dtype;
  throw py::type_error(std::string("ringdp does not support dtype ") + c10::toString(t));
}

// A DType code from Python (the raw CudaComm.all_reduce), checked against the table.
DType dtype_from_code(int code) {
  for (const auto& e : kDTypes)
    if (static_cast<int>(e.dtype) == code) return e.dtype;
  throw py::value_error("unknown ringdp dtype code " + std::to_string(code));
}

// The dtype of an output/input pair, which must agree (Python checks first, with a clearer
// message; this guards the raw binding).
DType same_dtype(const torch::Tensor& out, const torch::Tensor& in) {
  if (out.scalar_type() != in.scalar_type())
    throw py::type_error(std::string("ringdp: output dtype ") + c10::toString(out.scalar_type()) +
                         " differs from input dtype " + c10::toString(in.scalar_type()));
  return to_dtype(out.scalar_type());
}

std::vector<at::ScalarType> supported_dtypes() {
  std::vector<at::ScalarType> v;
  for (const auto& e : kDTypes) v.push_back(e.scalar);
  return v;
}

// The bytes of a registered tensor of `sizes` and `st` (ringdp.empty, CPU and CUDA): every
// product checked, so that a size whose byte count does not fit (2^62 float32 elements
// wrapped to 0 bytes: a tensor that claimed 2^62 elements on a 4 KiB block) is a ValueError
// naming the shape and the dtype, as is a negative dimension. At most 2^63 - 1 bytes
// (torch's sizes, strides and storage offsets are int64).
size_t registered_bytes(const std::vector<int64_t>& sizes, at::ScalarType st) {
  auto refuse = [&](const char* why) {
    std::string shape = "(";
    for (size_t i = 0; i < sizes.size(); ++i) shape += (i ? ", " : "") + std::to_string(sizes[i]);
    shape += sizes.size() == 1 ? ",)" : ")";
    return py::value_error(std::string("ringdp.empty: size ") + shape + " of " +
                           py::str(py::cast(st)).cast<std::string>() + why);
  };
  int64_t bytes = static_cast<int64_t>(c10::elementSize(st));
  for (int64_t s : sizes)
    if (s < 0) throw refuse(": a dimension is negative");
  for (int64_t s : sizes)
    if (__builtin_mul_overflow(bytes, s, &bytes)) throw refuse(": its byte count is past 2^63 - 1");
  return static_cast<size_t>(bytes);
}

// Whether the interpreter is shutting down (public as Py_IsFinalizing since Python 3.13, which
// dropped the underscored name: a build against 3.13 failed on it).
inline bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// A Python callable as a C++ callback that may run on any thread (it takes the GIL; not
// once the interpreter is finalizing). Errors it raises are reported as unraisable.
std::function<void(const std::string&)> python_callback(py::function f, const char* what) {
  auto fn = std::shared_ptr<py::function>(new py::function(std::move(f)), [](py::function* p) {
    if (!Py_IsInitialized() || python_finalizing()) return;  // leaked at exit: the GIL may be gone
    py::gil_scoped_acquire gil;
    delete p;
  });
  return [fn, what](const std::string& text) {
    if (!Py_IsInitialized() || python_finalizing()) return;
    py::gil_scoped_acquire gil;
    try {
      (*fn)(text);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable(what);
    }
  };
}

// Ctrl-C during a collective (common/interrupt.h). Python runs a signal's handler on its main
// thread between bytecodes, so a SIGINT that came while the main thread waited in C++ was
// handled only once the call returned: it waited out the timeout (300 s by default). The
// waits of the main thread look every 50 ms whether a SIGINT came. With Python's own handler
// (default_int_handler) the wait ends in the KeyboardInterrupt that handler raises. A
// handler of the program's is left for Python to run when the call returns, as before (the
// SIGINT is not looked at): it never runs inside a collective, where a collective of its
// own (a checkpoint saved on Ctrl-C) would wait for the very call it interrupted.
unsigned long g_main_thread = 0;  // threading.main_thread().ident, at import

void python_interrupt_check() {
  if (PyThread_get_thread_ident() != g_main_thread) return;
  static std::chrono::steady_clock::time_point next;  // (the main thread's alone)
  const auto now = std::chrono::steady_clock::now();
  if (now < next) return;
  next = now + std::chrono::milliseconds(50);
  if (!Py_IsInitialized() || python_finalizing()) return;
  py::gil_scoped_acquire gil;
  try {  // the program's own handler (or none): the SIGINT is left alone, for Python. (_signal's
    // C functions: signal.getsignal is Python code, whose first bytecode would run the handler)
    py::module_ signal = py::module_::import("_signal");
    if (!signal.attr("getsignal")(SIGINT).is(signal.attr("default_int_handler"))) return;
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_KeyboardInterrupt)) throw;  // (the handler ran after all: its exception)
    e.discard_as_unraisable("ringdp's look for a SIGINT");
    return;
  }
  if (!PyOS_InterruptOccurred()) return;  // (takes the SIGINT: its handler's KeyboardInterrupt is raised here)
  PyErr_SetNone(PyExc_KeyboardInterrupt);
  throw py::error_already_set();
}

// Flight records as dicts (names for kind, dtype and op; the algorithm's code).
py::list records_to_python(const std::vector<CallRecord>& records) {
  py::list out;
  static const char* status[] = {"running", "ok", "failed"};
  static const char* path[] = {"none", "oneshot", "ring_staged", "direct"};
  static_assert(sizeof(path) / sizeof(path[0]) == CallRecord::kDirect + 1, "a name for every path");
  for (const CallRecord& r : records) {
    py::dict d;
    d["seq"] = r.seq;
    d["kind"] = kind_name(static_cast<Kind>(r.kind));
    d["count"] = r.count;
    d["dtype"] = dtype_name(static_cast<DType>(r.dtype));
    d["op"] = redop_name(static_cast<RedOp>(r.op));
    d["algo"] = r.algo;
    d["tag"] = std::string(r.tag);
    d["status"] = (r.status >= 0 && r.status <= 2) ? status[r.status] : "unknown";
    d["path"] = (r.path >= 0 && r.path <= CallRecord::kDirect) ? path[r.path] : "unknown";
    d["t_start_us"] = r.t_start_us;
    d["t_end_us"] = r.t_end_us;
    out.append(d);
  }
  return out;
}

// Complete a torch future (torch.futures.Future) with tensors held as a C++ tensor list.
// Python's set_result holds a Python object, whose tensors torch's C++ readers (DDP's
// reducer) find by running Python (torch._jit_internal._extract_tensors), where a pending
// Ctrl-C lands. (toIValue: torch's own conversion of its Future type, in libtorch_python.)
void complete_future(const py::object& future, std::vector<at::Tensor> tensors) {
  auto fut = torch::jit::toIValue(future, c10::FutureType::create(c10::AnyType::get())).toFuture();
  py::gil_scoped_release release;  // (its callbacks take the GIL, as set_result's)
  fut->markCompleted(c10::IValue(std::move(tensors)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ringdp native extension";
  py::register_exception<RingError>(m, "RingError", PyExc_RuntimeError);
  g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  set_interrupt_check(&python_interrupt_check);

#ifdef RINGDP_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  m.attr("COMPILER") = __VERSION__;
  m.def("supported_dtypes", &supported_dtypes, "the torch dtypes ringdp reduces");
  m.def("complete_future", &complete_future, py::arg("future"), py::arg("tensors"),
        "complete a torch future with a list of tensors that torch's C++ readers take without Python");
  m.attr("TAG_BYTES") = kTagBytes;  // a collective's tag: at most TAG_BYTES - 1 bytes
  m.def("shm_segment_name", &shm::segment_name, py::arg("job"), py::arg("rank"),
        "the /dev/shm name of rank's segment in job, created by this process");
  m.def(
      "shm_reserved_bytes",
      [](size_t slots, size_t slot_bytes, size_t oneshot_bytes) {
        return shm::Geometry::make(slots, slot_bytes, oneshot_bytes, 0, 1).fixed_bytes();
      },
      py::arg("fifo_slots"), py::arg("slot_bytes"), py::arg("oneshot_bytes"),
      "the bytes of /dev/shm a rank reserves at set-up (its segment but the arena)");
  m.def("reap_stale_segments", &shm::reap_stale,
        "unlink segment names in /dev/shm whose creator is dead; returns the names removed");
  m.attr("BUILT_WITH_TORCH") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) +
                               "." + std::to_string(TORCH_VERSION_PATCH);

  py::class_<ShmConfig>(m, "ShmConfig")
      .def(py::init<>())
      .def_readwrite("rank", &ShmConfig::rank)
      .def_readwrite("world", &ShmConfig::world)
      .def_readwrite("name", &ShmConfig::name)
      .def_readwrite("host", &ShmConfig::host)
      .def_readwrite("fifo_slots", &ShmConfig::fifo_slots)
      .def_readwrite("slot_bytes", &ShmConfig::slot_bytes)
      .def_readwrite("oneshot_bytes", &ShmConfig::oneshot_bytes)
      .def_readwrite("arena_bytes", &ShmConfig::arena_bytes)
      .def_readwrite("spin_ns", &ShmConfig::spin_ns)
      .def_readwrite("stall_warn_s", &ShmConfig::stall_warn_s)
      .def_readwrite("flight_calls", &ShmConfig::flight_calls)
      .def_readwrite("rank_names", &ShmConfig::rank_names);

  // The lifecycle every transport endpoint shares (common/endpoint.h), bound once.
  py::class_<Endpoint, std::shared_ptr<Endpoint>>(m, "Endpoint")
      .def("local_blob", [](Endpoint& e) { return py::bytes(e.local_blob()); })
      .def("connect", [](Endpoint& e, const std::vector<py::bytes>& blobs) {
        std::vector<std::string> v(blobs.begin(), blobs.end());
        py::gil_scoped_release nogil;
        e.connect(v);
      });

  py::class_<ShmComm, Endpoint, std::shared_ptr<ShmComm>>(m, "ShmComm")
      .def(py::init<const ShmConfig&>())
      .def_property_readonly("name", &ShmComm::name)
      .def_property_readonly("rank", &ShmComm::rank)
      .def_property_readonly("world", &ShmComm::world)
      .def_property_readonly("calls", &ShmComm::calls)
      .def_property_readonly("aborted", &ShmComm::is_aborted)
      .def_property_readonly("arena_in_use", &ShmComm::arena_in_use)
      .def_property_readonly("oneshot_bytes", &ShmComm::oneshot_bytes)
      .def("unlink_own", &ShmComm::unlink_own)
      .def("abort", &ShmComm::request_abort, py::arg("why"), py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce",
          [](ShmComm& c, const torch::Tensor& t, int op, int algo, double timeout_s, const std::string& tag) {
            c.all_reduce(t.data_ptr(), static_cast<size_t>(t.numel()), to_dtype(t.scalar_type()),
                         static_cast<RedOp>(op), static_cast<Algo>(algo), timeout_s, tag);
          },
          py::arg("tensor"), py::arg("op"), py::arg("algo"), py::arg("timeout_s"), py::arg("tag") = "",
          py::call_guard<py::gil_scoped_release>())
      .def(
          "reduce_scatter",
          [](ShmComm& c, const torch::Tensor& out, const torch::Tensor& in, int op, int algo, double timeout_s,
             const std::string& tag) {
            c.reduce_scatter(in.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()),
                             same_dtype(out, in), static_cast<RedOp>(op), static_cast<Algo>(algo), timeout_s, tag);
          },
          py::arg("output"), py::arg("input"), py::arg("op"), py::arg("algo"), py::arg("timeout_s"),
          py::arg("tag") = "", py::call_guard<py::gil_scoped_release>())
      .def(
          "all_gather",
          [](ShmComm& c, const torch::Tensor& out, const torch::Tensor& in, int algo, double timeout_s,
             const std::string& tag) {
            c.all_gather(in.data_ptr(), out.data_ptr(), static_cast<size_t>(in.numel()), same_dtype(out, in),
                         static_cast<Algo>(algo), timeout_s, tag);
          },
          py::arg("output"), py::arg("input"), py::arg("algo"), py::arg("timeout_s"), py::arg("tag") = "",
          py::call_guard<py::gil_scoped_release>())
      .def(
          "broadcast",
          [](ShmComm& c, const torch::Tensor& t, int root, int algo, double timeout_s, const std::string& tag) {
            c.broadcast(t.data_ptr(), static_cast<size_t>(t.numel()), to_dtype(t.scalar_type()), root,
                        static_cast<Algo>(algo), timeout_s, tag);
          },
          py::arg("tensor"), py::arg("root"), py::arg("algo"), py::arg("timeout_s"), py::arg("tag") = "",
          py::call_guard<py::gil_scoped_release>())
      .def(
          "set_outer",  // `tensor`: the call's (reduce_scatter: its output; all_gather: its input)
          [](ShmComm& c, int kind, int arg, const torch::Tensor& t) {
            c.set_outer(static_cast<Kind>(kind), arg, static_cast<uint64_t>(t.numel()), to_dtype(t.scalar_type()));
          },
          py::arg("kind"), py::arg("arg"), py::arg("tensor"))
      .def("reject", &ShmComm::reject, py::arg("why"), py::arg("timeout_s"), py::arg("tag") = "",
           py::call_guard<py::gil_scoped_release>())
      .def_property("spin_ns", &ShmComm::spin_ns, &ShmComm::set_spin_ns)
      .def("set_stall_handler",
           [](ShmComm& c, py::function f) { c.set_stall_handler(python_callback(std::move(f), "ringdp stall handler")); })
      .def("flight_record", [](const ShmComm& c) { return records_to_python(c.flight_record()); })
      .def("is_registered",
           [](const ShmComm& c, const torch::Tensor& t) {
             return c.arena_offset_of(t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size()) >= 0;
           })
      .def("empty", [](std::shared_ptr<ShmComm> c, std::vector<int64_t> sizes, at::ScalarType st) {
        to_dtype(st);  // TypeError for a dtype ringdp does not reduce
        const size_t off = c->arena_alloc(registered_bytes(sizes, st));
        void* p = c->arena_base() + off;
        // The deleter keeps the communicator (and so the mapping) alive until the last
        // tensor sharing this storage is gone.
        return torch::from_blob(
            p, sizes, [c, off](void*) { c->arena_free(off); },
            torch::TensorOptions().dtype(st).device(torch::kCPU));
      });

#ifdef RINGDP_WITH_CUDA
  {
    using cuda::Comm;
    using cuda::Options;
    py::class_<Options>(m, "CudaOptions")
        .def(py::init<>())
        .def_property(
            "kind", [](const Options& o) { return o.kind == cuda::Kind::kNccl ? "nccl" : "ipc"; },
            [](Options& o, const std::string& k) {
              if (k == "ipc") o.kind = cuda::Kind::kIpc;
              else if (k == "nccl") o.kind = cuda::Kind::kNccl;
              else throw py::value_error("CudaOptions.kind must be 'ipc' or 'nccl', not '" + k + "'");
            })
        .def_readwrite("rank", &Options::rank)
        .def_readwrite("world", &Options::world)
        .def_readwrite("device", &Options::device)
        .def_readwrite("timeout_s", &Options::timeout_s)
        .def_readwrite("slot_bytes", &Options::slot_bytes)
        .def_readwrite("slots", &Options::slots)
        .def_readwrite("channels", &Options::channels)
        .def_readwrite("oneshot_bytes", &Options::oneshot_bytes)
        .def_readwrite("arena_bytes", &Options::arena_bytes)
        .def_readwrite("registered", &Options::registered)
        .def_readwrite("nccl_library", &Options::nccl_library)
        .def_readwrite("rank_names", &Options::rank_names);

    py::class_<Comm, Endpoint, std::shared_ptr<Comm>>(m, "CudaComm")
        // raw form (tests, benchmarks): pointer, count, dtype code, op code, cudaStream_t
        .def("all_reduce",
             [](Comm& c, uintptr_t ptr, size_t count, int dtype, int op, uintptr_t stream, int algo,
                double timeout_s) {
               c.all_reduce(ptr, count, dtype_from_code(dtype), static_cast<RedOp>(op), stream, algo,
                            timeout_s);
             },
             py::arg("ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("stream"),
             py::arg("algo"), py::arg("timeout_s") = 0.0, py::call_guard<py::gil_scoped_release>())
        .def("all_reduce_tensor",
             [](Comm& c, const torch::Tensor& t, int op, uintptr_t stream, int algo, double timeout_s) {
               c.all_reduce(reinterpret_cast<uintptr_t>(t.data_ptr()), static_cast<size_t>(t.numel()),
                            to_dtype(t.scalar_type()), static_cast<RedOp>(op), stream, algo, timeout_s);
             },
             py::call_guard<py::gil_scoped_release>())
        // the halves and broadcast on tensors (cuda_api.h); `stream`: cudaStream_t, `algo`: ring
        // or one-shot, as ringdp's policy chose
        .def("reduce_scatter_tensor",
             [](Comm& c, const torch::Tensor& out, const torch::Tensor& in, int op, uintptr_t stream, int algo,
                double timeout_s) {
               c.reduce_scatter(reinterpret_cast<uintptr_t>(in.data_ptr()), reinterpret_cast<uintptr_t>(out.data_ptr()),
                                static_cast<size_t>(out.numel()), same_dtype(out, in), static_cast<RedOp>(op), stream,
                                algo, timeout_s);
             },
             py::arg("output"), py::arg("input"), py::arg("op"), py::arg("stream"), py::arg("algo"),
             py::arg("timeout_s") = 0.0, py::call_guard<py::gil_scoped_release>())
        .def("all_gather_tensor",
             [](Comm& c, const torch::Tensor& out, const torch::Tensor& in, uintptr_t stream, int algo,
                double timeout_s) {
               c.all_gather(reinterpret_cast<uintptr_t>(in.data_ptr()), reinterpret_cast<uintptr_t>(out.data_ptr()),
                            static_cast<size_t>(in.numel()), same_dtype(out, in), stream, algo, timeout_s);
             },
             py::arg("output"), py::arg("input"), py::arg("stream"), py::arg("algo"), py::arg("timeout_s") = 0.0,
             py::call_guard<py::gil_scoped_release>())
        .def("broadcast_tensor",
             [](Comm& c, const torch::Tensor& t, int root, uintptr_t stream, int algo, double timeout_s) {
               c.broadcast(reinterpret_cast<uintptr_t>(t.data_ptr()), static_cast<size_t>(t.numel()),
                           to_dtype(t.scalar_type()), root, stream, algo, timeout_s);
             },
             py::arg("tensor"), py::arg("root"), py::arg("stream"), py::arg("algo"), py::arg("timeout_s") = 0.0,
             py::call_guard<py::gil_scoped_release>())
        .def("reject", &Comm::reject, py::call_guard<py::gil_scoped_release>())
        .def("check", &Comm::check, py::call_guard<py::gil_scoped_release>())
        .def("calls", &Comm::calls)
        .def("failure_of", &Comm::failure_of)
        .def("synchronize", &Comm::synchronize, py::call_guard<py::gil_scoped_release>())
        .def("abort", &Comm::abort, py::call_guard<py::gil_scoped_release>())
        .def("halt", &Comm::halt, py::call_guard<py::gil_scoped_release>())
        .def("follow", &Comm::follow, py::arg("leader"), py::call_guard<py::gil_scoped_release>())
        .def("quiesce", &Comm::quiesce, py::call_guard<py::gil_scoped_release>())
        .def("destroy", &Comm::destroy, py::call_guard<py::gil_scoped_release>())
        .def("is_registered",
             [](const Comm& c, const torch::Tensor& t) {
               return t.is_cuda() && c.is_registered(reinterpret_cast<uintptr_t>(t.data_ptr()),
                                                     static_cast<size_t>(t.numel()) * t.element_size());
             })
        .def("empty",
             [](std::shared_ptr<Comm> c, std::vector<int64_t> sizes, at::ScalarType st) {
               to_dtype(st);  // TypeError for a dtype ringdp does not reduce
               const uintptr_t p = c->alloc(registered_bytes(sizes, st));
               // The deleter keeps the communicator (and its IPC region) alive.
               return torch::from_blob(
                   reinterpret_cast<void*>(p), sizes, [c, p](void*) { c->free(p); },
                   torch::TensorOptions().dtype(st).device(torch::kCUDA, c->device()));
             })
        .def_property_readonly("stream", &Comm::stream)
        .def_property_readonly("device", &Comm::device)
        .def_property_readonly("oneshot_bytes", &Comm::oneshot_bytes)
        .def("describe", &Comm::describe);

    m.def("cuda_create", &cuda::create_comm, py::call_guard<py::gil_scoped_release>());
    m.def("cuda_nccl_available",
          [](const std::string& lib) { return cuda::nccl_available(lib, nullptr, nullptr); },
          py::arg("library") = "");
    m.def("cuda_nccl_info", [](const std::string& lib) {
      int v = 0;
      std::string why;
      bool ok = cuda::nccl_available(lib, &v, &why);
      return py::make_tuple(ok, v, why);
    }, py::arg("library") = "");
    m.def("cuda_device_count", &cuda::device_count);
  }
#endif

  // Schedule arithmetic, for the unit tests.
  m.def("chunk_begin", &ring::chunk_begin);
  m.def("chunk_end", &ring::chunk_end);
  m.def("rs_send_chunk", &ring::rs_send_chunk);
  m.def("rs_recv_chunk", &ring::rs_recv_chunk);
  m.def("ag_send_chunk", &ring::ag_send_chunk);
  m.def("ag_recv_chunk", &ring::ag_recv_chunk);
  m.def("owned_chunk", &ring::owned_chunk);
  m.def("ring_trace", &ring_trace, py::arg("count"), py::arg("world"), py::arg("rank"),
        py::arg("slice_elems"), py::arg("align"));
  m.def("collective_trace", &collective_trace, py::arg("kind"), py::arg("count"), py::arg("world"),
        py::arg("rank"), py::arg("slice_elems"), py::arg("align") = 1, py::arg("root") = 0);
  m.def("half_roundtrip", [](float f) { return cpu::half_to_float(cpu::float_to_half(f)); });
  m.def("bf16_roundtrip", [](float f) { return cpu::bf16_to_float(cpu::float_to_bf16(f)); });
}
