// pybind11 bindings of the core as pyinfinity._C. Buffers pass as integer addresses plus a
// "keepalive" object (the tensor) that the returned request holds until the transfer is done,
// so no torch type enters the core and one build serves any torch version. Every blocking call
// releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>

#include "pyinfinity/checksum.hpp"
#include "pyinfinity/cpu_adam.hpp"
#include "pyinfinity/cpu_isa.hpp"
#include "pyinfinity/cuda_adam.hpp"
#include "pyinfinity/cuda_runtime.hpp"
#include "pyinfinity/cuda_stager.hpp"
#include "pyinfinity/defaults.hpp"
#include "pyinfinity/error.hpp"
#include "pyinfinity/fault.hpp"
#include "pyinfinity/file_handle.hpp"
#include "pyinfinity/io_backend.hpp"
#include "pyinfinity/pinned_arena.hpp"
#include "pyinfinity/swap_engine.hpp"

namespace py = pybind11;
using namespace pyinfinity;

namespace {

// A request plus the Python object owning its memory. If dropped before completion, waits
// (without the GIL) so the memory is never freed under an in-flight transfer.
// How long a wait blocks without the GIL before it checks for signals (Ctrl-C acts within it).
constexpr double kSignalCheckSeconds = 0.1;

// Runs the signal handlers of the main thread; a handler that raised (KeyboardInterrupt) ends
// the wait with that exception. The transfer itself goes on; its request still owns the memory.
void check_signals() {
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// One slice of a wait without the GIL: true once finished.
inline bool wait_slice(const Request& r, double timeout, std::int64_t started) {
  return r.wait_slice(kSignalCheckSeconds, timeout, started);
}
inline bool wait_slice(const StageRequest& r, double timeout, std::int64_t started) {
  // a staged transfer's wait has no progress clock: the timeout is measured from the start
  if (timeout >= 0) {
    const double left = timeout - static_cast<double>(Request::clock_ns() - started) / 1e9;
    if (left <= kSignalCheckSeconds) {
      r.wait(std::max(0.0, left));  // TimeoutError when it runs out
      return true;
    }
  }
  try {
    r.wait(kSignalCheckSeconds);
  } catch (const TimeoutError&) {
    return false;
  }
  return true;
}

// A request plus the Python object owning its memory. If dropped before completion, waits
// (without the GIL) so the memory is never freed under an in-flight transfer.
template <typename R>
struct Pending {
  R req;
  py::object keepalive;
  Pending(R r, py::object k) : req(std::move(r)), keepalive(std::move(k)) {}
  ~Pending() {
    if (!req.done()) {
      py::gil_scoped_release nogil;
      while (!req.done()) {
        try {
          req.wait(std::numeric_limits<double>::max());
        } catch (...) {
          break;
        }
      }
    }
  }
  // Blocks without the GIL in slices, checking for signals between them (on the main thread a
  // Ctrl-C raises KeyboardInterrupt within kSignalCheckSeconds, even when the I/O is stuck).
  void wait(std::optional<double> timeout) {
    const double t = timeout ? *timeout : -1.0;
    const std::int64_t started = Request::clock_ns();
    for (;;) {
      bool finished;
      {
        py::gil_scoped_release nogil;
        finished = wait_slice(req, t, started);
      }
      if (finished) return;
      check_signals();
    }
  }
};
using PyRequest = Pending<Request>;
using PyStageRequest = Pending<StageRequest>;

OpenMode parse_mode(const std::string& m) {
  if (m == "r") return OpenMode::read;
  if (m == "w") return OpenMode::write;
  if (m == "rw" || m == "r+" || m == "w+") return OpenMode::read_write;
  throw ArgumentError("mode: expected 'r', 'w' or 'rw', got '" + m + "'");
}

py::dict direction(const DirectionStats& d) {
  py::dict o;
  o["bytes"] = d.bytes;
  o["ops"] = d.ops;
  o["errors"] = d.errors;
  o["seconds"] = d.busy_seconds;
  o["gbps"] = d.busy_seconds > 0 ? static_cast<double>(d.bytes) / d.busy_seconds / 1e9 : 0.0;
  return o;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyinfinity core: async NVMe I/O, pinned host memory, CUDA staging";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const SystemError& e) {
      py::object exc = py::module_::import("builtins").attr("OSError")(e.code(), e.message(), e.path());
      PyErr_SetObject(PyExc_OSError, exc.ptr());
    } catch (const ArgumentError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const CudaError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  py::class_<FileHandle, std::shared_ptr<FileHandle>>(m, "FileHandle")
      .def(py::init([](const std::string& path, const std::string& mode, bool direct) {
             return std::make_shared<FileHandle>(path, parse_mode(mode), direct);
           }),
           py::arg("path"), py::arg("mode") = "r", py::arg("direct") = true)
      .def_property_readonly("path", &FileHandle::path)
      .def_property_readonly("direct", &FileHandle::direct)
      .def_property_readonly("closed", &FileHandle::closed)
      .def_property_readonly("offset_align", &FileHandle::offset_align)
      .def_property_readonly("memory_align", &FileHandle::memory_align)
      .def_property_readonly("inflight", &FileHandle::inflight)
      .def("size", &FileHandle::size)
      .def("resize", &FileHandle::resize, py::arg("nbytes"))
      .def("allocate", &FileHandle::allocate, py::arg("nbytes"), py::call_guard<py::gil_scoped_release>())
      .def("sync", &FileHandle::sync, py::call_guard<py::gil_scoped_release>())
      .def("close", &FileHandle::close)
      .def("__repr__", [](const FileHandle& f) {
        return "<FileHandle " + f.path() + (f.direct() ? " O_DIRECT" : " buffered") +
               (f.closed() ? " closed>" : ">");
      });

  py::class_<PyRequest>(m, "Request")
      .def("done", [](const PyRequest& r) { return r.req.done(); })
      .def("wait", &PyRequest::wait, py::arg("timeout") = py::none(),
           "Block until done; OSError on I/O failure, TimeoutError after `timeout` s without progress")
      .def_property_readonly("nbytes", [](const PyRequest& r) { return r.req.nbytes(); })
      .def_property_readonly("offset", [](const PyRequest& r) { return r.req.offset(); })
      .def_property_readonly("is_write", [](const PyRequest& r) { return r.req.is_write(); })
      .def_property_readonly("path", [](const PyRequest& r) { return r.req.path(); })
      .def("checksums", [](const PyRequest& r) { return r.req.checksums(); },
           "CRC-32C per 64 KiB of the request (checksum=True writes, verified reads)");

  py::class_<SwapEngine, std::shared_ptr<SwapEngine>>(m, "SwapEngine")
      .def(py::init([](const std::string& backend, std::size_t block_size, std::size_t queue_depth,
                       std::size_t threads) {
             return std::make_shared<SwapEngine>(EngineOptions{backend, block_size, queue_depth, threads});
           }),
           py::arg("backend") = "auto", py::arg("block_size") = 1 << 20,
           py::arg("queue_depth") = 32, py::arg("threads") = 1)
      .def(
          "submit",
          [](SwapEngine& e, std::shared_ptr<FileHandle> file, std::uintptr_t ptr, std::size_t nbytes,
             std::int64_t offset, bool write, py::object keepalive, bool checksum,
             std::vector<std::uint32_t> expected, bool pad_tail) {
            Request r = [&] {
              py::gil_scoped_release nogil;  // "auto" may probe the directory
              return e.submit(std::move(file), reinterpret_cast<void*>(ptr), nbytes, offset, write,
                              checksum, std::move(expected), pad_tail);
            }();
            return std::make_unique<PyRequest>(std::move(r), std::move(keepalive));
          },
          py::arg("file"), py::arg("ptr"), py::arg("nbytes"), py::arg("offset"), py::arg("write"),
          py::arg("keepalive") = py::none(), py::arg("checksum") = false,
          py::arg("expected_checksums") = std::vector<std::uint32_t>{}, py::arg("pad_tail") = false)
      .def("backend_for", &SwapEngine::backend_for, py::call_guard<py::gil_scoped_release>())
      .def("close", &SwapEngine::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &SwapEngine::closed)
      .def_property_readonly("backend", [](const SwapEngine& e) { return e.options().backend; })
      .def_property_readonly("block_size", [](const SwapEngine& e) { return e.options().block_size; })
      .def_property_readonly("queue_depth", [](const SwapEngine& e) { return e.options().queue_depth; })
      .def_property_readonly("threads", [](const SwapEngine& e) { return e.options().threads; })
      .def("reset_stats", &SwapEngine::reset_stats)
      .def("stats", [](const SwapEngine& e) {
        EngineStats s = e.stats();
        py::dict d;
        d["read"] = direction(s.read);
        d["write"] = direction(s.write);
        d["pieces"] = s.pieces;
        d["bounced"] = s.bounced;
        d["buffered"] = s.buffered;
        d["retries"] = s.retries;
        d["short_resubmits"] = s.short_resubmits;
        return d;
      });

  py::class_<PinnedSlab>(m, "PinnedSlab", py::buffer_protocol())
      .def_buffer([](PinnedSlab& s) {
        return py::buffer_info(s.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(s.nbytes())}, {1});
      })
      .def_property_readonly("ptr", [](const PinnedSlab& s) { return reinterpret_cast<std::uintptr_t>(s.data()); })
      .def_property_readonly("nbytes", &PinnedSlab::nbytes)
      .def_property_readonly("valid", &PinnedSlab::valid)
      .def("free", &PinnedSlab::release);

  py::class_<PinnedArena>(m, "PinnedArena")
      .def(py::init<std::size_t, const std::string&>(), py::arg("capacity"), py::arg("lock") = "auto",
           py::call_guard<py::gil_scoped_release>())
      .def("allocate", &PinnedArena::allocate, py::arg("nbytes"))
      .def_property_readonly("locked_by", &PinnedArena::locked_by)
      .def_property_readonly("lock_note", &PinnedArena::lock_note)
      .def_property_readonly("base", [](const PinnedArena& a) { return reinterpret_cast<std::uintptr_t>(a.base()); })
      .def("stats", [](const PinnedArena& a) {
        ArenaStats s = a.stats();
        py::dict d;
        d["capacity"] = s.capacity;
        d["in_use"] = s.in_use;
        d["high_water"] = s.high_water;
        d["slabs"] = s.slabs;
        d["largest_free"] = s.largest_free;
        return d;
      });

  py::class_<PyStageRequest>(m, "StageRequest")
      .def("done", [](const PyStageRequest& r) { return r.req.done(); })
      .def("wait", &PyStageRequest::wait, py::arg("timeout") = py::none());

  py::class_<CudaStager>(m, "CudaStager")
      .def(py::init<std::shared_ptr<SwapEngine>, int, std::size_t, std::size_t>(), py::arg("engine"),
           py::arg("device") = 0, py::arg("chunk_bytes") = defaults::stager_chunk_bytes(),
           py::arg("num_buffers") = defaults::stager_buffers(), py::call_guard<py::gil_scoped_release>())
      .def(
          "read_to_device",
          [](CudaStager& s, std::shared_ptr<FileHandle> f, std::int64_t offset, std::uintptr_t ptr,
             std::size_t n, std::uintptr_t stream, py::object keep) {
            StageRequest r = s.read_to_device(std::move(f), offset, reinterpret_cast<void*>(ptr), n, stream);
            return std::make_unique<PyStageRequest>(std::move(r), std::move(keep));
          },
          py::arg("file"), py::arg("offset"), py::arg("ptr"), py::arg("nbytes"), py::arg("stream") = 0,
          py::arg("keepalive") = py::none())
      .def(
          "write_from_device",
          [](CudaStager& s, std::shared_ptr<FileHandle> f, std::int64_t offset, std::uintptr_t ptr,
             std::size_t n, std::uintptr_t stream, py::object keep) {
            StageRequest r = s.write_from_device(std::move(f), offset, reinterpret_cast<const void*>(ptr), n, stream);
            return std::make_unique<PyStageRequest>(std::move(r), std::move(keep));
          },
          py::arg("file"), py::arg("offset"), py::arg("ptr"), py::arg("nbytes"), py::arg("stream") = 0,
          py::arg("keepalive") = py::none())
      .def(
          "copy",
          [](CudaStager& s, std::uintptr_t dst, std::uintptr_t src, std::size_t n, bool h2d,
             std::uintptr_t stream, bool sync) {
            s.copy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n, h2d, stream, sync);
          },
          py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("host_to_device"),
          py::arg("stream") = 0, py::arg("synchronize") = false, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("chunk_bytes", &CudaStager::chunk_bytes)
      .def_property_readonly("num_buffers", &CudaStager::num_buffers)
      .def("stats", [](const CudaStager& s) {
        StagerStats st = s.stats();
        py::dict d;
        d["h2d_bytes"] = st.h2d_bytes;
        d["d2h_bytes"] = st.d2h_bytes;
        d["h2d_seconds"] = st.h2d_seconds;
        d["d2h_seconds"] = st.d2h_seconds;
        return d;
      });

  m.attr("CHECKSUM_BLOCK") = kChecksumBlock;
  m.def("crc32c", [](py::buffer b, std::uint32_t crc) {
    py::buffer_info info = b.request();
    const auto n = static_cast<std::size_t>(info.size * info.itemsize);
    py::gil_scoped_release nogil;
    return pyinfinity::crc32c(info.ptr, n, crc);
  }, py::arg("data"), py::arg("crc") = 0);
  m.def("copy_crc32c", [](py::buffer dst, py::buffer src, int threads) {
    py::buffer_info d = dst.request(true), s = src.request();
    for (const py::buffer_info* b : {&d, &s}) {
      if (b->ndim != 1 || b->strides[0] != b->itemsize) throw py::value_error("copy_crc32c: expected 1-D contiguous buffers");
    }
    const auto n = static_cast<std::size_t>(d.size * d.itemsize);
    if (static_cast<std::size_t>(s.size * s.itemsize) != n) {
      throw py::value_error("copy_crc32c: dst has " + std::to_string(n) + " bytes, src " +
                            std::to_string(s.size * s.itemsize));
    }
    py::gil_scoped_release nogil;
    return pyinfinity::copy_crc32c(d.ptr, s.ptr, n, threads);
  }, py::arg("dst"), py::arg("src"), py::arg("threads") = 1);
  m.def("crc32c_hardware", &crc32c_hardware);
  // The CPU optimizer steps: addresses of contiguous host arrays (no torch type in the core), the
  // hyperparameters, the threads and the instruction set ("auto": PYINFINITY_CPU_ISA, else the best).
  auto hyper = [](float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw, std::int64_t step,
                  float grad_scale) {
    pyinfinity::AdamHyper h;
    h.lr = lr;
    h.beta1 = beta1;
    h.beta2 = beta2;
    h.eps = eps;
    h.weight_decay = weight_decay;
    h.adamw = adamw;
    h.step = step;
    h.grad_scale = grad_scale;
    return h;
  };
  auto grad_type = [](int t, const char* what) {
    PYINF_EXPECT(t == 0 || t == 1, std::string(what) + ": grad_type must be 0 (fp32) or 1 (bf16)");
    return static_cast<pyinfinity::GradType>(t);
  };
  auto state8 = [](std::uintptr_t master, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
                   std::uintptr_t exp_avg_scale, std::uintptr_t exp_avg_sq_scale) {
    return pyinfinity::Adam8bitState{reinterpret_cast<float*>(master), reinterpret_cast<std::uint8_t*>(exp_avg),
                                     reinterpret_cast<std::uint8_t*>(exp_avg_sq),
                                     reinterpret_cast<float*>(exp_avg_scale),
                                     reinterpret_cast<float*>(exp_avg_sq_scale)};
  };
  m.def(
      "adam_step",
      [hyper, grad_type](std::uintptr_t master, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, std::uintptr_t grad,
                         int gtype, std::uintptr_t out_bf16, std::size_t n, float lr, float beta1, float beta2,
                         float eps, float weight_decay, bool adamw, std::int64_t step, float grad_scale, int threads,
                         const std::string& isa) {
        const auto h = hyper(lr, beta1, beta2, eps, weight_decay, adamw, step, grad_scale);
        const auto gt = grad_type(gtype, "adam_step");
        const CpuIsa want = parse_isa(isa);
        py::gil_scoped_release nogil;
        pyinfinity::adam_step(reinterpret_cast<float*>(master), reinterpret_cast<float*>(exp_avg),
                              reinterpret_cast<float*>(exp_avg_sq), reinterpret_cast<const void*>(grad), gt,
                              reinterpret_cast<std::uint16_t*>(out_bf16), n, h, threads, want);
      },
      py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("grad_type"),
      py::arg("out_bf16"), py::arg("n"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("adamw"), py::arg("step"), py::arg("grad_scale"), py::arg("threads"),
      py::arg("isa") = "auto",
      "Adam/AdamW over n fp32 parameters in one pass (addresses of contiguous host arrays; the gradient in "
      "fp32 or bf16, the new weights also written as bf16 to out_bf16 when it is not 0). Releases the GIL.");
  m.def(
      "accumulate_grad",
      [grad_type](std::uintptr_t dst, std::uintptr_t src, int gtype, std::size_t n, bool copy, int threads) {
        const auto gt = grad_type(gtype, "accumulate_grad");
        py::gil_scoped_release nogil;
        pyinfinity::accumulate_grad(reinterpret_cast<float*>(dst), reinterpret_cast<const void*>(src), gt, n, copy,
                                    threads);
      },
      py::arg("dst"), py::arg("src"), py::arg("grad_type"), py::arg("n"), py::arg("copy"), py::arg("threads"),
      "dst += src (dst = src with copy) over n elements: dst fp32, src fp32 (grad_type 0) or bf16 (1), addresses of "
      "contiguous host arrays; the sums of torch's dst.add_(src) bit for bit. Releases the GIL.");
  m.def(
      "adam_step_8bit",
      [hyper, grad_type, state8](std::uintptr_t master, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
                                 std::uintptr_t exp_avg_scale, std::uintptr_t exp_avg_sq_scale, std::uintptr_t grad,
                                 int gtype, std::uintptr_t out_bf16, std::size_t n, float lr, float beta1, float beta2,
                                 float eps, float weight_decay, bool adamw, std::int64_t step, float grad_scale,
                                 int threads, const std::string& isa) {
        const auto h = hyper(lr, beta1, beta2, eps, weight_decay, adamw, step, grad_scale);
        const auto gt = grad_type(gtype, "adam_step_8bit");
        const CpuIsa want = parse_isa(isa);
        const auto s = state8(master, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale);
        py::gil_scoped_release nogil;
        pyinfinity::adam_step_8bit(s, reinterpret_cast<const void*>(grad), gt,
                                   reinterpret_cast<std::uint16_t*>(out_bf16), n, h, threads, want);
      },
      py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("exp_avg_scale"),
      py::arg("exp_avg_sq_scale"), py::arg("grad"), py::arg("grad_type"), py::arg("out_bf16"), py::arg("n"),
      py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"),
      py::arg("step"), py::arg("grad_scale"), py::arg("threads"), py::arg("isa") = "auto",
      "Adam/AdamW over n parameters of the 8-bit state in one pass: the fp32 master (n), the E4M3 codes of "
      "exp_avg and the unsigned E4M4 codes of sqrt(exp_avg_sq) (n bytes each), their fp32 scales "
      "(QUANT_BLOCK parameters a scale); gradient and out_bf16 as adam_step. Releases the GIL.");
  m.def(
      "adam_step_bf16",
      [hyper, grad_type](std::uintptr_t param, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, std::uintptr_t grad,
                         int gtype, std::uintptr_t out_bf16, std::size_t n, float lr, float beta1, float beta2,
                         float eps, float weight_decay, bool adamw, std::int64_t step, float grad_scale, int threads,
                         const std::string& isa) {
        const auto h = hyper(lr, beta1, beta2, eps, weight_decay, adamw, step, grad_scale);
        const auto gt = grad_type(gtype, "adam_step_bf16");
        const CpuIsa want = parse_isa(isa);
        py::gil_scoped_release nogil;
        pyinfinity::adam_step_bf16(reinterpret_cast<std::uint16_t*>(param), reinterpret_cast<std::uint16_t*>(exp_avg),
                                   reinterpret_cast<std::uint16_t*>(exp_avg_sq), reinterpret_cast<const void*>(grad),
                                   gt, reinterpret_cast<std::uint16_t*>(out_bf16), n, h, threads, want);
      },
      py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("grad_type"),
      py::arg("out_bf16"), py::arg("n"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("adamw"), py::arg("step"), py::arg("grad_scale"), py::arg("threads"),
      py::arg("isa") = "auto",
      "Adam/AdamW over n parameters whose master weights and moments are bf16 (DeepSpeed's "
      "bf16_master_weights_and_grads + bf16_optimizer_states), stepped in fp32 and rounded to nearest even. "
      "The gradient (fp32 or bf16) must not overlap them; out_bf16 (0: none; may be the gradient) receives the "
      "new weights in the same pass. Releases the GIL.");
  m.def("cuda_adam_kernels", &cuda::adam_kernels_compiled,
        "Whether this build has the CUDA kernels of the compressed optimizer states' device steps.");
  m.def(
      "cuda_adam_step_8bit",
      [hyper, grad_type, state8](std::uintptr_t master, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
                                 std::uintptr_t exp_avg_scale, std::uintptr_t exp_avg_sq_scale, std::uintptr_t grad,
                                 int gtype, std::uintptr_t out, int out_type, std::size_t n, float lr, float beta1,
                                 float beta2, float eps, float weight_decay, bool adamw, std::int64_t step,
                                 float grad_scale, int device, std::uintptr_t stream) {
        const auto h = hyper(lr, beta1, beta2, eps, weight_decay, adamw, step, grad_scale);
        const auto gt = grad_type(gtype, "cuda_adam_step_8bit");
        PYINF_EXPECT(out_type >= 0 && out_type <= 3, "cuda_adam_step_8bit: out_type must be 0 (none), 1 (bf16), "
                                                     "2 (fp16) or 3 (fp32)");
        const auto s = state8(master, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale);
        py::gil_scoped_release nogil;
        cuda::adam_step_8bit(s, reinterpret_cast<const void*>(grad), gt, reinterpret_cast<void*>(out),
                             static_cast<cuda::OutType>(out_type), n, h, device, stream);
      },
      py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("exp_avg_scale"),
      py::arg("exp_avg_sq_scale"), py::arg("grad"), py::arg("grad_type"), py::arg("out"), py::arg("out_type"),
      py::arg("n"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
      py::arg("adamw"), py::arg("step"), py::arg("grad_scale"), py::arg("device"), py::arg("stream"),
      "adam_step_8bit on CUDA device `device`, queued on `stream` (a cudaStream_t's address; returns without "
      "waiting): the same bits as the CPU kernel. out: the new weights in out_type (0 none, 1 bf16, 2 fp16, "
      "3 fp32); may be the gradient. Raises CudaError when the launch fails.");
  m.def(
      "cuda_adam_step_bf16",
      [hyper, grad_type](std::uintptr_t param, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, std::uintptr_t grad,
                         int gtype, std::uintptr_t out_bf16, std::size_t n, float lr, float beta1, float beta2,
                         float eps, float weight_decay, bool adamw, std::int64_t step, float grad_scale, int device,
                         std::uintptr_t stream) {
        const auto h = hyper(lr, beta1, beta2, eps, weight_decay, adamw, step, grad_scale);
        const auto gt = grad_type(gtype, "cuda_adam_step_bf16");
        py::gil_scoped_release nogil;
        cuda::adam_step_bf16(reinterpret_cast<std::uint16_t*>(param), reinterpret_cast<std::uint16_t*>(exp_avg),
                             reinterpret_cast<std::uint16_t*>(exp_avg_sq), reinterpret_cast<const void*>(grad), gt,
                             reinterpret_cast<std::uint16_t*>(out_bf16), n, h, device, stream);
      },
      py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("grad_type"),
      py::arg("out_bf16"), py::arg("n"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("adamw"), py::arg("step"), py::arg("grad_scale"), py::arg("device"),
      py::arg("stream"),
      "adam_step_bf16 on CUDA device `device`, queued on `stream`: the same bits as the CPU kernel; out_bf16 "
      "(0: none; may be the gradient) receives the new weights. Raises CudaError when the launch fails.");
  m.def(
      "quantize_moments",
      [state8](std::uintptr_t exp_avg_in, std::uintptr_t exp_avg_sq_in, std::size_t n, std::uintptr_t exp_avg,
               std::uintptr_t exp_avg_sq, std::uintptr_t exp_avg_scale, std::uintptr_t exp_avg_sq_scale, int threads,
               const std::string& isa) {
        const CpuIsa want = parse_isa(isa);
        const auto s = state8(0, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale);
        py::gil_scoped_release nogil;
        pyinfinity::quantize_moments(reinterpret_cast<const float*>(exp_avg_in),
                                     reinterpret_cast<const float*>(exp_avg_sq_in), n, s, threads, want);
      },
      py::arg("exp_avg_in"), py::arg("exp_avg_sq_in"), py::arg("n"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("exp_avg_scale"), py::arg("exp_avg_sq_scale"), py::arg("threads") = 1, py::arg("isa") = "auto",
      "fp32 moments (n each) -> the 8-bit state's codes and scales. Releases the GIL.");
  m.def(
      "dequantize_moments",
      [state8](std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, std::uintptr_t exp_avg_scale,
               std::uintptr_t exp_avg_sq_scale, std::size_t n, std::uintptr_t exp_avg_out,
               std::uintptr_t exp_avg_sq_out, int threads, const std::string& isa) {
        const CpuIsa want = parse_isa(isa);
        const auto s = state8(0, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale);
        py::gil_scoped_release nogil;
        pyinfinity::dequantize_moments(s, n, reinterpret_cast<float*>(exp_avg_out),
                                       reinterpret_cast<float*>(exp_avg_sq_out), threads, want);
      },
      py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("exp_avg_scale"), py::arg("exp_avg_sq_scale"),
      py::arg("n"), py::arg("exp_avg_out"), py::arg("exp_avg_sq_out"), py::arg("threads") = 1,
      py::arg("isa") = "auto", "The 8-bit state's codes and scales -> fp32 moments (n each). Releases the GIL.");
  m.attr("QUANT_BLOCK") = pyinfinity::kQuantBlock;
  m.def(
      "cpu_isa", [](const std::string& requested) { return std::string(isa_name(resolve_isa(parse_isa(requested)))); },
      py::arg("requested") = "auto",
      "The instruction set a CPU optimizer step runs with: the one requested, or for 'auto' PYINFINITY_CPU_ISA, "
      "else the best this CPU has (ValueError for one it lacks).");
  m.def(
      "cpu_isas",
      [] {
        py::list out;
        for (CpuIsa isa : supported_isas()) out.append(std::string(isa_name(isa)));
        return out;
      },
      "The instruction sets the CPU optimizer steps can run with here, baseline first.");
  m.def("compiled_backends", &compiled_backends);
  m.def(
      "probe_backend",
      [](const std::string& dir) {
        ProbeResult r = [&] {
          py::gil_scoped_release nogil;
          return probe_backend(dir);
        }();
        py::dict d;
        d["best"] = r.best;
        d["direct_io"] = r.direct_io;
        d["working"] = r.working;
        d["failures"] = r.failures;
        return d;
      },
      py::arg("dir"));
  m.def("cuda_compiled", &cuda::compiled);
  m.def("cuda_device_count", &cuda::device_count, py::call_guard<py::gil_scoped_release>());
  m.def("cuda_status", &cuda::status);
  m.def("defaults", [] {
    py::list out;
    for (const auto& e : defaults::table()) {
      py::dict d;
      d["name"] = e.name;
      d["env"] = e.env;
      d["value"] = e.value;
      d["doc"] = e.doc;
      out.append(d);
    }
    return out;
  });
  m.def(
      "set_fault",
      [](const std::string& op, std::uint64_t nth, const std::string& action, int value, std::uint64_t count) {
        FaultSpec s = FaultInjector::parse("op=" + op + ",action=" + action);
        s.nth = nth;
        s.value = value;
        s.count = count;
        FaultInjector::instance().set(s);
      },
      py::arg("op") = "any", py::arg("nth") = 1, py::arg("action") = "errno", py::arg("value") = 5,
      py::arg("count") = 1);
  m.def("clear_fault", [] { FaultInjector::instance().clear(); });
  m.def("faults_injected", [] { return FaultInjector::instance().injected(); });
  m.def("build_info", [] {
    py::dict d;
    d["version"] = PYINFINITY_VERSION;
    d["backends"] = compiled_backends();
    d["cuda"] = cuda::compiled();
    d["cuda_kernels"] = cuda::adam_kernels_compiled();
#ifdef PYINFINITY_CUDA_VERSION
    d["cuda_version"] = PYINFINITY_CUDA_VERSION;
#else
    d["cuda_version"] = py::none();
#endif
    d["compiler"] = std::string(__VERSION__);
    d["build_type"] = PYINFINITY_BUILD_TYPE;
    d["cxx_flags"] = PYINFINITY_CXX_FLAGS;
    d["sanitizer"] = PYINFINITY_SANITIZER;
    return d;
  });
}
