// Python binding of the native radix tree (module `hicache_native_*`, loaded by
// hicache/tree/native.py). Nodes cross as integer handles (common.h); the Python
// wrapper turns them into proxy objects. Inputs are checked here, before the
// tree is touched, so bad input raises ValueError / TypeError and leaves the
// tree unchanged. Token ids are read in place from int32 tensors, int32 numpy
// arrays and bytes; int64 input is narrowed once into a scratch buffer.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/python.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <limits>
#include <mutex>

#include "allocator.h"
#include "lifecycle.h"
#include "tree.h"

namespace py = pybind11;
using hicache::IndexRun;
using hicache::Lifecycle;
using hicache::NodeHandle;
using hicache::RadixTree;
using hicache::token_t;
using hicache::TreeNode;

namespace {

constexpr std::int64_t kMaxToken = std::numeric_limits<token_t>::max();


std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

// Holds a tree's op_mutex for one call (tree.h): a second thread waits here,
// with the GIL released, until the first one's call returns, however often
// that call runs Python code (hooks, a tensor freed) that lets other threads in.
// The owning thread re-enters freely (a hook calling back).
class TreeLock {
 public:
  explicit TreeLock(const RadixTree& tree) : mutex_(tree.op_mutex()) {
    if (!mutex_.try_lock()) {
      py::gil_scoped_release nogil;
      mutex_.lock();
    }
  }
  ~TreeLock() { mutex_.unlock(); }
  TreeLock(const TreeLock&) = delete;
  TreeLock& operator=(const TreeLock&) = delete;

 private:
  std::recursive_mutex& mutex_;
};

// A shape as Python prints a tuple of ints: (), (3,), (2, 2).
template <typename Sizes>
std::string shape_repr(const Sizes& sizes) {
  std::string out = "(";
  for (const auto d : sizes) out += std::to_string(d) + ", ";
  if (std::size(sizes) > 0) out.resize(out.size() - 2);
  if (std::size(sizes) == 1) out += ",";
  return out + ")";
}

// A tensor's layout as Python names it (torch.sparse_coo, ...).
std::string layout_name(py::handle tensor) { return py::str(tensor.attr("layout")); }

// The whole-page tokens of one call, and whatever keeps their memory alive.
// `unchecked`: all the caller's ids (partial page included) when read_key left
// them to the tree's match or insert to check (RadixTree::match); empty when
// they are checked (or bytes, which are never checked).
struct Key {
  hicache::token_span span;
  hicache::token_span unchecked;
  at::Tensor holder;
  std::vector<token_t> scratch;
  std::optional<py::buffer_info> buffer;

  // Check the ids left unchecked now (the tree will not).
  void check() {
    hicache::check_ids(unchecked.data(), unchecked.size());
    unchecked = {};
  }
};

using hicache::check_ids;

// Checks all `count` ids (the trailing partial page's too: a bad id there is the
// same caller mistake) and keeps the first n (whole pages).
template <typename T>
void narrow_ids(const char* base, std::ptrdiff_t stride_bytes, std::size_t count, std::size_t n,
                Key& key) {
  key.scratch.resize(count);
  bool ok = true;
  T lo = 0;
  T hi = 0;
  for (std::size_t i = 0; i < count; ++i) {
    T v;
    std::memcpy(&v, base + static_cast<std::ptrdiff_t>(i) * stride_bytes, sizeof(T));
    ok &= v >= 0 && static_cast<std::int64_t>(v) <= kMaxToken;
    lo = i == 0 ? v : std::min(lo, v);
    hi = i == 0 ? v : std::max(hi, v);
    key.scratch[i] = static_cast<token_t>(v);
  }
  key.scratch.resize(n);
  if (!ok) {
    throw hicache::ValueError("tokens: expected ids in [0, " + std::to_string(kMaxToken) +
                              "], got range [" + std::to_string(lo) + ", " + std::to_string(hi) +
                              "]");
  }
  key.span = {key.scratch.data(), n};
}

// Accepts an int32/int64 1-D CPU tensor, an int32/int64 1-D buffer (numpy), or
// bytes already made by hicache.tree.token_key. Only whole pages are kept.
// With `lazy`, ids read in place are left in key.unchecked for the tree's match
// or insert (the only callers that pass it) instead of being checked here.
void read_key(py::handle obj, std::int64_t page_size, Key& key, bool lazy = false) {
  const auto whole = [page_size](std::int64_t n) {
    return static_cast<std::size_t>(n / page_size * page_size);
  };
  if (THPVariable_Check(obj.ptr())) {
    at::Tensor t = THPVariable_Unpack(obj.ptr());
    // The checks of hicache.tree.token_key, in its order.
    if (t.is_meta()) {
      throw hicache::ValueError("tokens: expected a tensor with data (CPU or CUDA), got device meta");
    }
    if (t.layout() != at::kStrided) {
      throw hicache::ValueError("tokens: expected a dense tensor, got layout " + layout_name(obj));
    }
    const auto dtype = t.scalar_type();
    if (dtype != at::kInt && dtype != at::kLong) {
      throw hicache::TypeError(std::string("tokens: expected an int32 or int64 tensor, got dtype ") +
                               c10::toString(dtype));
    }
    if (t.dim() != 1) {  // hicache.tree.token_key's words (numpy's shape)
      throw hicache::ValueError("tokens: expected a 1-D sequence, got shape " +
                                shape_repr(t.sizes()));
    }
    if (!t.is_cpu()) t = t.cpu();
    const auto count = static_cast<std::size_t>(t.size(0));
    const std::size_t n = whole(t.size(0));
    const auto stride = t.stride(0) * static_cast<std::int64_t>(t.element_size());
    const char* base = static_cast<const char*>(t.const_data_ptr());
    if (dtype == at::kInt && (t.stride(0) == 1 || count <= 1)) {
      const auto* ids = reinterpret_cast<const token_t*>(base);
      if (lazy) {
        key.unchecked = {ids, count};
      } else {
        check_ids(ids, count);
      }
      key.span = {ids, n};
      key.holder = std::move(t);
    } else if (dtype == at::kInt) {
      narrow_ids<std::int32_t>(base, stride, count, n, key);
    } else {
      narrow_ids<std::int64_t>(base, stride, count, n, key);
    }
    return;
  }
  if (PyBytes_Check(obj.ptr())) {
    const auto nbytes = static_cast<std::size_t>(PyBytes_GET_SIZE(obj.ptr()));
    if (nbytes % (sizeof(token_t) * static_cast<std::size_t>(page_size)) != 0) {
      throw hicache::ValueError("key: expected whole pages of int32 tokens (" +
                                std::to_string(sizeof(token_t) * page_size) +
                                " bytes each), got " + std::to_string(nbytes) + " bytes");
    }
    const char* data = PyBytes_AS_STRING(obj.ptr());
    if (reinterpret_cast<std::uintptr_t>(data) % alignof(token_t) == 0) {
      key.span = {reinterpret_cast<const token_t*>(data), nbytes / sizeof(token_t)};
    } else {
      key.scratch.resize(nbytes / sizeof(token_t));
      std::memcpy(key.scratch.data(), data, nbytes);
      key.span = {key.scratch.data(), key.scratch.size()};
    }
    return;
  }
  if (PyObject_CheckBuffer(obj.ptr())) {
    key.buffer = py::reinterpret_borrow<py::buffer>(obj).request();
    const py::buffer_info& info = *key.buffer;
    if (info.ndim != 1) {
      throw hicache::ValueError("tokens: expected a 1-D sequence, got shape " +
                                shape_repr(info.shape));
    }
    const char fmt = info.format.empty() ? '?' : info.format.back();
    const bool is_int = fmt == 'i' || fmt == 'l' || fmt == 'q';
    const auto count = static_cast<std::size_t>(info.shape[0]);
    const std::size_t n = whole(info.shape[0]);
    const char* base = static_cast<const char*>(info.ptr);
    if (is_int && info.itemsize == 4) {
      const bool direct = info.strides[0] == 4 &&
                          reinterpret_cast<std::uintptr_t>(base) % alignof(token_t) == 0;
      if (direct) {
        const auto* ids = reinterpret_cast<const token_t*>(base);
        if (lazy) {
          key.unchecked = {ids, count};
        } else {
          check_ids(ids, count);
        }
        key.span = {ids, n};
      } else {
        narrow_ids<std::int32_t>(base, info.strides[0], count, n, key);
      }
      return;
    }
    if (is_int && info.itemsize == 8) {
      narrow_ids<std::int64_t>(base, info.strides[0], count, n, key);
      return;
    }
    throw hicache::TypeError("tokens: expected int32 or int64 token ids, got buffer format '" +
                             info.format + "'");
  }
  throw hicache::TypeError("tokens: expected a torch tensor, numpy array or bytes, got " +
                           type_name(obj));
}

// A 1-D int64 CPU tensor of page ids. With `copy`, a copy the tree owns (what it
// keeps must not follow the caller re-pointing, resizing or refilling its
// tensor); else the caller's tensor for the call's duration (made contiguous).
IndexRun read_pages(py::handle obj, const char* name, bool copy = false) {
  if (!THPVariable_Check(obj.ptr())) {
    throw hicache::TypeError(std::string(name) + ": expected an int64 torch.Tensor, got " +
                             type_name(obj));
  }
  at::Tensor t = THPVariable_Unpack(obj.ptr());
  // The errors of hicache/checks.py's check_page_tensor: dtype is a type error,
  // shape a value error.
  if (t.scalar_type() != at::kLong) {
    throw hicache::TypeError(std::string(name) + ": expected dtype torch.int64, got " +
                             c10::toString(t.scalar_type()));
  }
  if (t.layout() != at::kStrided) {
    throw hicache::ValueError(std::string(name) + ": expected a dense tensor, got layout " +
                              layout_name(obj));
  }
  if (t.dim() != 1) {
    throw hicache::ValueError(std::string(name) + ": expected a 1-D tensor, got shape " +
                              shape_repr(t.sizes()));
  }
  if (!t.is_cpu()) {
    throw hicache::ValueError(std::string(name) + ": expected a CPU tensor, got device " +
                              t.device().str());
  }
  if (!t.is_contiguous()) {
    t = t.contiguous();  // a copy already
  } else if (copy) {
    // One allocation and a memcpy: much cheaper than clone() through the dispatcher.
    at::Tensor own = at::empty({t.size(0)}, at::kLong);
    if (t.size(0) != 0) {  // an empty tensor's data pointer may be null
      std::memcpy(own.data_ptr(), t.const_data_ptr(),
                  static_cast<std::size_t>(t.size(0)) * sizeof(hicache::page_id_t));
    }
    t = std::move(own);
  }
  const std::int64_t n = t.size(0);
  return IndexRun{std::move(t), 0, n};
}

// read_pages, plus the insert check: one page id per whole page of the key.
// Without `copy`, the caller's tensor: for RadixTree::insert with `borrowed`.
IndexRun read_pages(py::handle obj, const char* name, const Key& key, const RadixTree& tree,
                    bool copy = true) {
  IndexRun pages = read_pages(obj, name, copy);
  const auto num_pages = static_cast<std::int64_t>(key.span.size()) / tree.page_size();
  if (pages.num_pages != num_pages) {
    throw hicache::ValueError(std::string(name) + ": expected one page id per whole page (" +
                              std::to_string(num_pages) + "), got " +
                              std::to_string(pages.num_pages));
  }
  return pages;
}

// The UTF-8 bytes of a str, or nothing when it has none (a lone surrogate).
std::optional<std::string> utf8(py::handle s) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(s.ptr(), &size);
  if (data == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  return std::string(data, static_cast<std::size_t>(size));
}

std::uint32_t ns_of(RadixTree& tree, py::handle ns) {
  if (ns.is_none()) return tree.namespace_index(std::nullopt);
  if (!PyUnicode_Check(ns.ptr())) {
    throw hicache::TypeError("namespace: expected str or None, got " + type_name(ns));
  }
  std::optional<std::string> name = utf8(ns);
  if (!name) {  // the words of hicache/tree/python/state.py, the root of a namespace
    throw hicache::ValueError("namespace: expected a str encodable as UTF-8, got " +
                              std::string(py::repr(ns)));
  }
  return tree.namespace_index(*name);
}

// The namespace's index if it exists (read-only lookups create none; a non-str
// namespace, or one with no UTF-8 form, names no root).
std::optional<std::uint32_t> existing_ns(const RadixTree& tree, py::handle ns) {
  if (ns.is_none()) return tree.find_namespace(std::nullopt);
  if (!PyUnicode_Check(ns.ptr())) return std::nullopt;
  std::optional<std::string> name = utf8(ns);
  if (!name) return std::nullopt;
  return tree.find_namespace(*name);
}

// ns_of for a call whose key may hold unchecked ids (read_key's `lazy`). The tree
// checks them before it changes anything, but not before creating a namespace's
// root or refusing a call from inside a hook: then they are checked here first,
// so that every error comes in the order of an eager check.
std::uint32_t ns_of_lazy(RadixTree& tree, py::handle ns, Key& key, const char* op) {
  if (!key.unchecked.empty() && !tree.in_hook()) {
    if (const std::optional<std::uint32_t> index = existing_ns(tree, ns)) return *index;
  }
  key.check();
  tree.check_reentry(op);  // (before a root is made, as the Python tree refuses it)
  return ns_of(tree, ns);
}

TreeNode* node_of(const RadixTree& tree, NodeHandle handle, const char* op) {
  TreeNode* node = tree.find(handle);
  if (node == nullptr) {
    // (a freed namespace root: id 0, as the Python tree words it)
    throw hicache::ValueError(std::string(op) + ": node " + std::to_string(handle < 0 ? 0 : handle) +
                              " is no longer in the tree (stale)");
  }
  return node;
}

// A removed node still readable from Python (accessors), or a live one.
TreeNode* readable_node(const RadixTree& tree, NodeHandle handle, const char* op) {
  TreeNode* node = tree.find_any(handle);
  if (node == nullptr) {
    throw hicache::ValueError(std::string(op) + ": node " + std::to_string(handle) +
                              " was freed (stale)");
  }
  return node;
}

// The handle of a node about to reach Python (from then on removal detaches it).
NodeHandle out(TreeNode* node) {
  node->exported = true;
  return node->handle;
}

py::object maybe_tensor(const IndexRun& run) {
  if (!run.defined()) return py::none();
  return py::cast(run.tensor());
}

// The int32 bytes of tokens (what hicache.tree.token_key returns for them).
py::bytes key_bytes(hicache::token_span span) {
  return py::bytes(reinterpret_cast<const char*>(span.data()), span.size() * sizeof(token_t));
}

py::tuple evict_result(const hicache::EvictOut& out) {
  return py::make_tuple(out.pages, out.num_evicted_tokens, out.num_backup_tokens);
}

// One run per component of the tree (None: nothing given); the wrapper has checked
// them (hicache/tree/guards.py check_component_pages).
std::vector<IndexRun> component_runs(const RadixTree& tree, const py::list& given) {
  std::vector<IndexRun> runs(tree.components().size());
  if (given.empty()) return runs;
  if (given.size() != runs.size()) {
    throw hicache::ValueError("components: expected one entry per component of the tree");
  }
  for (std::size_t c = 0; c < runs.size(); ++c) {
    if (!given[c].is_none()) runs[c] = read_pages(given[c], "components");
  }
  return runs;
}

std::vector<NodeHandle> handles(const std::vector<TreeNode*>& nodes) {
  std::vector<NodeHandle> result;
  result.reserve(nodes.size());
  for (TreeNode* n : nodes) result.push_back(out(n));
  return result;
}

// A FreeList whose arrays live in tensors Python reads (PageAllocator's
// integrity check sees the same memory).
struct TensorFreeList {
  at::Tensor free_stack;
  at::Tensor in_use;
  hicache::FreeList list;

  TensorFreeList(const std::string& name, std::int64_t num_pages)
      : free_stack(at::empty({num_pages}, at::kLong)),
        in_use(at::empty({num_pages}, at::kBool)),
        list(name, num_pages, free_stack.data_ptr<hicache::page_id_t>(),
             in_use.data_ptr<bool>()) {}
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hicache native radix tree (see hicache/tree/native.py)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const hicache::ReentryError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const hicache::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const hicache::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const std::logic_error& e) {
      PyErr_SetString(PyExc_AssertionError, e.what());
    }
  });

  py::class_<RadixTree>(m, "Tree")
      .def(py::init([](std::int64_t page_size, const std::string& eviction,
                       const std::vector<std::tuple<bool, std::int64_t, std::int64_t>>& components) {
        using hicache::EvictionPolicy;
        std::vector<hicache::ComponentKind> kinds;
        for (const auto& [window, width, window_pages] : components) {
          kinds.push_back({window, width, window_pages});
        }
        static const std::pair<const char*, EvictionPolicy> kPolicies[] = {
            {"lru", EvictionPolicy::LRU},   {"lfu", EvictionPolicy::LFU},
            {"fifo", EvictionPolicy::FIFO}, {"mru", EvictionPolicy::MRU},
            {"filo", EvictionPolicy::FILO}, {"priority", EvictionPolicy::Priority},
            {"slru", EvictionPolicy::SLRU},
        };
        for (const auto& [name, policy] : kPolicies) {
          if (eviction == name) return std::make_unique<RadixTree>(page_size, policy, kinds);
        }
        throw hicache::ValueError(
            "eviction: expected one of lru, lfu, fifo, mru, filo, priority, slru, got '" +
            eviction + "'");
      }), py::arg("page_size"), py::arg("eviction"),
           py::arg("components") = std::vector<std::tuple<bool, std::int64_t, std::int64_t>>{})
      .def_readwrite("num_nodes", &RadixTree::num_nodes)
      .def_readwrite("device_evictable_tokens", &RadixTree::device_evictable_tokens)
      .def_readwrite("device_protected_tokens", &RadixTree::device_protected_tokens)
      .def_readwrite("host_evictable_tokens", &RadixTree::host_evictable_tokens)
      .def_readwrite("host_protected_tokens", &RadixTree::host_protected_tokens)
      .def_readwrite("host_takeable_tokens", &RadixTree::host_takeable_tokens)
      .def_readwrite("device_component_evictable_pages",
                     &RadixTree::device_component_evictable_pages)
      .def_readwrite("host_component_takeable_pages", &RadixTree::host_component_takeable_pages)
      // --- Components (hybrid trees; the wrapper checks component indices and tiers).
      .def("num_component_pages",
           [](RadixTree& t, std::size_t c, bool host) { TreeLock guard(t);
             return t.num_component_pages(c, host);
           })
      .def("match_full",
           [](RadixTree& t, py::handle tokens, py::handle ns) { TreeLock guard(t);
             Key key;
             read_key(tokens, t.page_size(), key);
             t.check_reentry("match");  // (before a root is made)
             const auto m = t.match(key.span, ns_of(t, ns));
             return py::make_tuple(m.device_len, m.host_len, out(m.last_device), out(m.last),
                                   m.full_len);
           })
      .def("insert_components",
           [](RadixTree& t, py::handle tokens, py::handle device_indices, py::handle ns,
              const py::list& given) { TreeLock guard(t);
             Key key;
             read_key(tokens, t.page_size(), key);
             const IndexRun pages = read_pages(device_indices, "device_indices", key, t);
             t.check_reentry("insert");  // (before a root is made)
             const auto [r, unused] =
                 t.insert_components(key.span, pages, ns_of(t, ns), component_runs(t, given));
             return py::make_tuple(r.num_cached_tokens, out(r.last), unused);
           })
      .def("insert_host_components",
           [](RadixTree& t, py::handle tokens, py::handle host_indices, py::handle ns,
              const py::list& given) { TreeLock guard(t);
             Key key;
             read_key(tokens, t.page_size(), key);
             const IndexRun pages = read_pages(host_indices, "host_indices", key, t);
             t.check_reentry("insert_host");  // (before a root is made)
             const auto [r, unused] =
                 t.insert_host_components(key.span, pages, ns_of(t, ns), component_runs(t, given));
             return py::make_tuple(r.num_cached_tokens, out(r.last), unused);
           })
      .def("probe_hit",
           [](RadixTree& t, py::handle tokens, py::handle ns) { TreeLock guard(t);
             Key key;
             read_key(tokens, t.page_size(), key);
             return t.probe_hit(key.span, existing_ns(t, ns));
           })
      .def("attach_component",
           [](RadixTree& t, NodeHandle h, std::size_t c, bool host, py::handle pages) {
             TreeLock guard(t);
             TreeNode* node = node_of(t, h, "attach_component");
             t.attach_component(node, c, host, read_pages(pages, "pages", /*copy=*/true));
           })
      .def("detach_component",
           [](RadixTree& t, NodeHandle h, std::size_t c, bool host) { TreeLock guard(t);
             return t.detach_component(node_of(t, h, "detach_component"), c, host);
           })
      .def("evict_component",
           [](RadixTree& t, std::size_t c, bool host, std::int64_t num_pages) { TreeLock guard(t);
             return evict_result(t.evict_component(c, host, num_pages));
           })
      .def("component_table",
           [](RadixTree& t, NodeHandle h, std::size_t c, bool host) { TreeLock guard(t);
             return t.component_table(node_of(t, h, "component_table"), c, host);
           })
      .def("component_pages",
           [](RadixTree& t, NodeHandle h, std::size_t c, bool host) { TreeLock guard(t);
             const TreeNode* node = readable_node(t, h, "component_pages");
             if (!node->comps) return py::object(py::none());
             return maybe_tensor(node->comps[c].in(host));
           })
      .def("component_stamps",
           [](RadixTree& t, NodeHandle h, std::size_t c) { TreeLock guard(t);
             const TreeNode* node = readable_node(t, h, "component_stamps");
             const hicache::ComponentRecord& r = node->comps[c];
             return py::make_tuple(r.last_access, r.hit_count, r.created);
           })
      .def("set_on_split",
           [](RadixTree& t, py::object fn) { TreeLock guard(t);
             if (fn.is_none()) {
               t.on_split = nullptr;
             } else {
               t.on_split = [fn](TreeNode* prefix, TreeNode* suffix) {
                 fn(out(prefix), out(suffix));
               };
             }
           })
      .def("root", [](RadixTree& t, py::handle ns) { TreeLock guard(t); return out(t.root(ns_of(t, ns))); })
      .def("namespaces", [](RadixTree& t) { TreeLock guard(t); return t.namespaces(); })
      .def("prune_namespaces", [](RadixTree& t) { TreeLock guard(t); return t.prune_namespaces(); })
      // A live node's handle the Lifecycle returned without exporting (see `out`).
      .def("export", [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return out(node_of(t, h, "export")); })
      .def("match",
           [](RadixTree& t, py::handle tokens, py::handle ns) { TreeLock guard(t);
             Key key;
             read_key(tokens, t.page_size(), key, /*lazy=*/true);
             const std::uint32_t index = ns_of_lazy(t, ns, key, "match");
             const auto m = t.match(key.span, index, key.unchecked);
             return py::make_tuple(m.device_len, m.host_len, out(m.last_device), out(m.last));
           })
      .def("insert",
           [](RadixTree& t, py::handle tokens, py::handle device_indices, py::handle ns) { TreeLock guard(t);
             Key key;
             read_key(tokens, t.page_size(), key, /*lazy=*/true);
             IndexRun pages;
             try {  // the tree copies what it keeps of them (borrowed)
               pages = read_pages(device_indices, "device_indices", key, t, /*copy=*/false);
             } catch (...) {
               key.check();  // bad tokens are reported first
               throw;
             }
             const std::uint32_t index = ns_of_lazy(t, ns, key, "insert");
             const auto r = t.insert(key.span, pages, index, key.unchecked, /*borrowed=*/true);
             return py::make_tuple(r.num_cached_tokens, out(r.last));
           })
      .def("insert_host",
           [](RadixTree& t, py::handle tokens, py::handle host_indices, py::handle ns) { TreeLock guard(t);
             Key key;
             read_key(tokens, t.page_size(), key);
             const IndexRun pages = read_pages(host_indices, "host_indices", key, t);
             t.check_reentry("insert_host");  // (before a root is made)
             const auto r = t.insert_host(key.span, pages, ns_of(t, ns));
             return py::make_tuple(r.num_cached_tokens, out(r.last));
           })
      .def("probe",
           [](RadixTree& t, py::handle tokens, py::handle ns) { TreeLock guard(t);
             Key key;
             read_key(tokens, t.page_size(), key);
             return t.probe(key.span, existing_ns(t, ns));
           })
      .def("probe_path",
           [](RadixTree& t, py::handle tokens, py::handle ns) { TreeLock guard(t);
             Key key;
             read_key(tokens, t.page_size(), key);
             std::vector<TreeNode*> path;
             t.probe(key.span, existing_ns(t, ns), &path);
             return handles(path);
           })
      .def("lock", [](RadixTree& t, NodeHandle h) { TreeLock guard(t); t.lock(node_of(t, h, "lock")); })
      .def("unlock", [](RadixTree& t, NodeHandle h) { TreeLock guard(t); t.unlock(node_of(t, h, "unlock")); })
      .def("host_lock",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t); t.host_lock(node_of(t, h, "host_lock")); })
      .def("host_unlock",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t); t.host_unlock(node_of(t, h, "host_unlock")); })
      .def("raise_priority",
           [](RadixTree& t, NodeHandle h, std::int64_t priority) { TreeLock guard(t);
             t.raise_priority(node_of(t, h, "raise_priority"), priority);
           })
      .def("set_io_status",
           [](RadixTree& t, NodeHandle h, int status) { TreeLock guard(t);
             if (status < 0 || status > 2) {
               throw hicache::ValueError("set_io_status: expected 0, 1 or 2, got " +
                                         std::to_string(status));
             }
             t.set_io_status(node_of(t, h, "set_io_status"),
                             static_cast<hicache::IOStatus>(status));
           })
      .def("attach_device",
           [](RadixTree& t, NodeHandle h, py::handle pages) { TreeLock guard(t);
             TreeNode* node = node_of(t, h, "attach_device");
             t.attach_device(node, read_pages(pages, "device_indices", /*copy=*/true));
           })
      .def("detach_device",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return t.detach_device(node_of(t, h, "detach_device")); })
      .def("attach_host",
           [](RadixTree& t, NodeHandle h, py::handle pages) { TreeLock guard(t);
             TreeNode* node = node_of(t, h, "attach_host");
             t.attach_host(node, read_pages(pages, "host_indices", /*copy=*/true));
           })
      .def("detach_host",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return t.detach_host(node_of(t, h, "detach_host")); })
      .def("evict_device",
           [](RadixTree& t, std::int64_t num_tokens, py::object backup) { TreeLock guard(t);
             if (backup.is_none()) return evict_result(t.evict_device(num_tokens, nullptr));
             const RadixTree::BackupHook hook = [&backup](TreeNode* node) {
               const py::object result = backup(out(node));
               const int truth = PyObject_IsTrue(result.ptr());
               if (truth < 0) throw py::error_already_set();
               return truth == 1;
             };
             return evict_result(t.evict_device(num_tokens, &hook));
           })
      .def("evict_host",
           [](RadixTree& t, std::int64_t num_tokens, bool drop_device_resident) { TreeLock guard(t);
             return evict_result(t.evict_host(num_tokens, drop_device_resident));
           })
      .def("device_indices_of",
           [](RadixTree& t, NodeHandle h, py::handle extra) { TreeLock guard(t);
             TreeNode* node = node_of(t, h, "device_indices_of");
             if (extra.is_none()) return t.device_indices_of(node);
             const IndexRun run = read_pages(extra, "extra");
             return t.device_indices_of(node, &run);
           })
      .def("path_to",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t);
             std::vector<TreeNode*> path;
             for (TreeNode* n = node_of(t, h, "path_to"); n->parent != nullptr; n = n->parent) {
               path.push_back(n);
             }
             std::reverse(path.begin(), path.end());
             return handles(path);
           })
      .def("path_missing_host",
           [](RadixTree& t, NodeHandle h, std::int64_t min_hit_count) { TreeLock guard(t);
             return handles(t.path_missing_host(node_of(t, h, "path_missing_host"), min_hit_count));
           })
      .def("host_only_path",
           [](RadixTree& t, NodeHandle last, NodeHandle last_device) { TreeLock guard(t);
             TreeNode* stop = node_of(t, last_device, "host_only_path");
             return handles(t.host_only_path(node_of(t, last, "host_only_path"), stop));
           })
      .def("nodes", [](RadixTree& t) { TreeLock guard(t); return handles(t.nodes()); })
      .def("live",
           [](RadixTree& t, const std::vector<NodeHandle>& hs) { TreeLock guard(t);
             std::vector<NodeHandle> result;
             for (NodeHandle h : hs) {
               if (t.find(h) != nullptr) result.push_back(h);
             }
             return result;
           })
      .def("release_detached", [](RadixTree& t, const std::vector<NodeHandle>& keep) { TreeLock guard(t); t.release_detached(keep); })
      .def("num_detached", [](RadixTree& t) { TreeLock guard(t); return t.num_detached(); })
      .def("enable_events", [](RadixTree& t) { TreeLock guard(t); t.enable_events(); })
      .def("take_events",
           [](RadixTree& t) { TreeLock guard(t);
             py::list out;
             for (const auto& e : t.take_events()) {
               py::object ns = e.ns ? py::object(py::str(*e.ns)) : py::none();
               py::object parent = e.parent ? py::object(py::int_(*e.parent)) : py::none();
               out.append(py::make_tuple(e.stored, e.device ? "device" : "host", ns, parent,
                                         py::cast(e.hashes), e.num_tokens));
             }
             return out;
           })
      .def("node_hashes",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t);
             TreeNode* node = node_of(t, h, "node_hashes");
             if (node->parent == nullptr) {
               throw hicache::ValueError(
                   "node_hashes: expected a non-root node, got a root (it holds no pages)");
             }
             auto [parent, hashes] = t.node_hashes(node);
             py::object p = parent ? py::object(py::int_(*parent)) : py::none();
             return py::make_tuple(p, py::cast(hashes));
           })
      .def("check_integrity", [](RadixTree& t) { TreeLock guard(t); return t.check_integrity(); })
      .def("memory_bytes", [](RadixTree& t) { TreeLock guard(t); return t.memory_bytes(); })
      // Node accessors (all take a handle; a stale one raises ValueError).
      .def("node_id", [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return readable_node(t, h, "id")->id; })
      .def("parent",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t);
             TreeNode* p = readable_node(t, h, "parent")->parent;
             return p == nullptr ? hicache::kNoNode : out(p);
           })
      .def("children",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t);
             const TreeNode* node = readable_node(t, h, "children");
             const auto ps = static_cast<std::size_t>(t.page_size());
             py::list result;
             for (TreeNode* c = node->first_child; c != nullptr; c = c->next_sibling) {
               result.append(py::make_tuple(key_bytes(c->tokens.span().first(ps)), out(c)));
             }
             return result;
           })
      .def("namespace",
           [](RadixTree& t, NodeHandle h) -> py::object { TreeLock guard(t);
             const auto name = t.node_namespace(readable_node(t, h, "namespace"));
             if (!name) return py::none();
             return py::str(*name);
           })
      .def("key",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t);
             return key_bytes(readable_node(t, h, "key")->tokens.span());
           })
      .def("device_indices",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return maybe_tensor(readable_node(t, h, "device_indices")->device); })
      .def("host_indices",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return maybe_tensor(readable_node(t, h, "host_indices")->host); })
      .def("num_tokens", [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return readable_node(t, h, "num_tokens")->num_tokens(); })
      .def("on_device", [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return readable_node(t, h, "on_device")->on_device(); })
      .def("on_host", [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return readable_node(t, h, "on_host")->on_host(); })
      .def("lock_ref", [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return readable_node(t, h, "lock_ref")->lock_ref; })
      .def("host_lock_ref",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return readable_node(t, h, "host_lock_ref")->host_lock_ref; })
      .def("io_status",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t);
             return static_cast<int>(readable_node(t, h, "io_status")->io_status);
           })
      .def("hit_count", [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return readable_node(t, h, "hit_count")->hit_count; })
      .def("last_access",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return readable_node(t, h, "last_access")->last_access; })
      .def("created", [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return readable_node(t, h, "created")->created; })
      .def("priority",
           [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return readable_node(t, h, "priority")->priority; })
      .def("repr", [](RadixTree& t, NodeHandle h) { TreeLock guard(t); return readable_node(t, h, "repr")->repr(); })
      // Overwrite a lock count without any bookkeeping: for corruption tests only.
      .def("set_lock_ref",
           [](RadixTree& t, NodeHandle h, std::int64_t v) { TreeLock guard(t); readable_node(t, h, "lock_ref")->lock_ref = v; })
      .def("set_host_lock_ref", [](RadixTree& t, NodeHandle h, std::int64_t v) { TreeLock guard(t);
        readable_node(t, h, "host_lock_ref")->host_lock_ref = v;
      });

  // The page allocator's free list (hicache/memory/allocator.py checks types first).
  py::class_<TensorFreeList>(m, "FreeList")
      .def(py::init([](const std::string& name, std::int64_t num_pages) {
        if (num_pages < 0) {
          throw hicache::ValueError("num_pages: expected >= 0, got " + std::to_string(num_pages));
        }
        return std::make_unique<TensorFreeList>(name, num_pages);
      }))
      .def_readonly("free_stack", &TensorFreeList::free_stack)
      .def_readonly("in_use", &TensorFreeList::in_use)
      .def_property_readonly("num_free", [](const TensorFreeList& f) { return f.list.num_free(); })
      .def("alloc",
           [](TensorFreeList& f, std::int64_t n) -> py::object {
             if (n < 0) {
               throw hicache::ValueError("num_pages: expected >= 0, got " + std::to_string(n));
             }
             if (n > f.list.num_free()) return py::none();
             at::Tensor out = hicache::new_page_tensor(n);
             f.list.alloc(n, out.data_ptr<hicache::page_id_t>());
             return py::cast(out);
           })
      .def("free", [](TensorFreeList& f, py::handle pages) {
        const IndexRun run = read_pages(pages, "pages");
        f.list.free(run.data(), run.num_pages);
      });

  // HiCache's bookkeeping-only lifecycle (hicache/cache/facade.py delegates to it).
  // It keeps the tree and both free lists alive. Lock nodes cross as handles
  // that are not exported (no proxy is made for them in the hot path): such a
  // node is freed when it leaves the tree, unless Python exports it first.
  py::class_<Lifecycle>(m, "Lifecycle")
      .def(py::init([](RadixTree& tree, TensorFreeList& device, TensorFreeList& host,
                       const std::string& write_policy, std::int64_t backup_hit_threshold,
                       std::int64_t load_threshold_tokens, std::int64_t page_nbytes,
                       bool has_host_tier) {
             hicache::LifecycleConfig config;
             if (write_policy == "write_through") {
               config.write_policy = hicache::WritePolicy::WriteThrough;
             } else if (write_policy == "write_through_selective") {
               config.write_policy = hicache::WritePolicy::WriteThroughSelective;
             } else if (write_policy == "write_back") {
               config.write_policy = hicache::WritePolicy::WriteBack;
             } else {
               throw hicache::ValueError(
                   "write_policy: expected 'write_through', 'write_through_selective' or "
                   "'write_back', got '" + write_policy + "'");
             }
             config.backup_hit_threshold = backup_hit_threshold;
             config.load_threshold_tokens = load_threshold_tokens;
             config.page_nbytes = page_nbytes;
             config.has_host_tier = has_host_tier;
             return std::make_unique<Lifecycle>(tree, device.list, host.list, config);
           }),
           py::keep_alive<1, 2>(), py::keep_alive<1, 3>(), py::keep_alive<1, 4>())
      .def_property_readonly_static("counter_names",
                                    [](py::object) {
                                      py::tuple names(hicache::kLifecycleCounterNames.size());
                                      for (std::size_t i = 0; i < names.size(); ++i) {
                                        names[i] = py::str(hicache::kLifecycleCounterNames[i]);
                                      }
                                      return names;
                                    })
      .def("match",
           [](Lifecycle& lc, py::handle tokens, py::handle ns, std::int64_t num_tokens,
              bool load_back) { TreeLock guard(lc.tree());
             RadixTree& t = lc.tree();
             Key key;
             read_key(tokens, t.page_size(), key);
             const auto m = lc.match(key.span, ns_of(t, ns), num_tokens, load_back);
             return py::make_tuple(m.lock->handle, m.device_len, m.host_len, m.prefix_len,
                                   key_bytes(key.span));
           })
      .def("alloc",
           [](Lifecycle& lc, std::int64_t num_pages) -> py::object { TreeLock guard(lc.tree());
             std::optional<at::Tensor> pages = lc.alloc_device(num_pages);
             if (!pages) return py::none();
             return py::cast(*pages);
           })
      .def("insert",
           [](Lifecycle& lc, py::handle tokens, py::handle ns, NodeHandle lock, py::handle owned,
              py::handle prefix_key, std::int64_t prefix_len) -> py::object { TreeLock guard(lc.tree());
             RadixTree& t = lc.tree();
             Key key;
             read_key(tokens, t.page_size(), key);
             Key prefix;
             read_key(prefix_key, t.page_size(), prefix);
             TreeNode* node = node_of(t, lock, "insert");
             const std::uint32_t k = ns_of(t, ns);
             std::optional<IndexRun> run;
             if (!owned.is_none()) run = read_pages(owned, "owned");
             const auto r = lc.insert(key.span, k, node, run ? &*run : nullptr, prefix.span,
                                      prefix_len);
             if (!r) return py::none();
             py::object rest = r->rest.size(0) != 0 ? py::cast(r->rest) : py::none();
             return py::make_tuple(r->last->handle, r->new_tokens, key_bytes(key.span), rest);
           })
      .def("release",
           [](Lifecycle& lc, NodeHandle lock, py::handle owned) { TreeLock guard(lc.tree());
             TreeNode* node = node_of(lc.tree(), lock, "release");
             if (owned.is_none()) return lc.release(node, nullptr);
             const IndexRun run = read_pages(owned, "owned");
             lc.release(node, &run);
           })
      .def("take_counters", [](Lifecycle& lc) { TreeLock guard(lc.tree());
        const auto values = lc.take_counters();
        return py::tuple(py::cast(std::vector<std::int64_t>(values.begin(), values.end())));
      });
}
