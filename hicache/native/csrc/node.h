// One node of the native radix tree: a run of whole pages, where their KV lives
// in each tier, locks, IO status and access statistics.
//
// Token runs and index runs are windows over shared storage: splitting a node
// moves two windows and copies nothing. Tensors are materialized (a `narrow`
// view) only when Python asks for a node's indices.
//
// Knows nothing of the tree's invariants or of eviction order (tree.h).
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "common.h"

namespace hicache {

// A window over token storage shared by every node cut from one insert.
struct TokenRun {
  std::shared_ptr<token_t[]> storage;
  std::size_t storage_len = 0;  // tokens in the whole storage (for memory accounting)
  const token_t* data = nullptr;
  std::size_t len = 0;

  token_span span() const { return {data, len}; }

  static TokenRun copy_of(token_span tokens) {
    TokenRun run;
    run.storage = std::make_shared_for_overwrite<token_t[]>(tokens.size());
    std::copy(tokens.begin(), tokens.end(), run.storage.get());
    run.storage_len = tokens.size();
    run.data = run.storage.get();
    run.len = tokens.size();
    return run;
  }

  TokenRun prefix(std::size_t n) const {
    TokenRun run = *this;
    run.len = n;
    return run;
  }

  // a followed by b: the window grows when b continues a in the same storage,
  // else both are copied into new storage.
  static TokenRun join(const TokenRun& a, const TokenRun& b) {
    if (a.storage == b.storage && a.data + a.len == b.data) {
      TokenRun run = a;
      run.len += b.len;
      return run;
    }
    TokenRun run;
    run.storage = std::make_shared_for_overwrite<token_t[]>(a.len + b.len);
    std::copy(a.data, a.data + a.len, run.storage.get());
    std::copy(b.data, b.data + b.len, run.storage.get() + a.len);
    run.storage_len = a.len + b.len;
    run.data = run.storage.get();
    run.len = run.storage_len;
    return run;
  }

  TokenRun suffix(std::size_t n_skip) const {
    TokenRun run = *this;
    run.data += n_skip;
    run.len -= n_skip;
    return run;
  }
};

// A new 1-D int64 CPU tensor of n page ids, uninitialized (the caller fills it):
// at::empty's result, made without a trip through the dispatcher (the tree makes
// one or more per call; no dispatch mode or device applies to them).
inline at::Tensor new_page_tensor(std::int64_t n) {
  return at::Tensor(at::detail::empty_cpu({n}, at::kLong));
}

// A window [offset, offset + num_pages) over a 1-D contiguous int64 CPU tensor,
// or "no copy in this tier" when `base` is undefined.
struct IndexRun {
  at::Tensor base;
  std::int64_t offset = 0;
  std::int64_t num_pages = 0;

  bool defined() const { return base.defined(); }

  const page_id_t* data() const {
    return static_cast<const page_id_t*>(base.const_data_ptr()) + offset;
  }

  IndexRun slice(std::int64_t start, std::int64_t n) const {
    return IndexRun{base, offset + start, n};
  }

  // This window, or a copy of it when its tensor's storage is more than twice
  // its size: the tree keeps windows for as long as a node lives, and a window
  // into a request's whole page table would keep all of it alive. So the index
  // storage the tree holds is at most twice the bytes of the page ids it caches.
  IndexRun owned() const {
    const auto bytes = static_cast<std::size_t>(num_pages) * sizeof(page_id_t);
    if (!defined() || base.storage().nbytes() <= 2 * bytes) return *this;
    return copied();
  }

  // A copy of this window (defined) in a tensor of its own: for windows of a
  // caller's tensor, which the tree must not keep.
  IndexRun copied() const {
    at::Tensor copy = new_page_tensor(num_pages);
    if (num_pages != 0) {  // an empty tensor's data pointer may be null
      std::memcpy(copy.data_ptr(), data(), static_cast<std::size_t>(num_pages) * sizeof(page_id_t));
    }
    return IndexRun{std::move(copy), 0, num_pages};
  }

  // A view of the window (no copy), always a tensor object of its own: a caller
  // that re-points it (`set_`, `resize_`) changes only its own object, never
  // the tensor the tree holds.
  at::Tensor tensor() const {
    if (offset == 0 && num_pages == base.size(0)) return base.alias();
    return base.narrow(0, offset, num_pages);
  }

  // a followed by b (both defined): the window grows when b continues a in the
  // same tensor, else a new tensor holds both.
  static IndexRun join(const IndexRun& a, const IndexRun& b) {
    if (a.base.unsafeGetTensorImpl() == b.base.unsafeGetTensorImpl() &&
        a.offset + a.num_pages == b.offset) {
      return IndexRun{a.base, a.offset, a.num_pages + b.num_pages};
    }
    at::Tensor both = new_page_tensor(a.num_pages + b.num_pages);
    auto* dst = static_cast<page_id_t*>(both.data_ptr());
    std::copy(a.data(), a.data() + a.num_pages, dst);
    std::copy(b.data(), b.data() + b.num_pages, dst + a.num_pages);
    return IndexRun{std::move(both), 0, a.num_pages + b.num_pages};
  }

  void reset() {
    base.reset();
    offset = 0;
    num_pages = 0;
  }
};

// One component's data on one node (hybrid models: components.h, and
// hicache/tree/python/node.py ComponentRecord): its page ids in each tier (a window
// component: `width` ids per page of the node; a state component: the `width` ids
// of the checkpoint at the node's end), its own access stamps (refreshed only when
// a hit reads it), its heap seqs, and for a window component the children holding
// it in each tier.
struct ComponentRecord {
  IndexRun device;
  IndexRun host;
  std::int64_t last_access = 0;  // tree clock tick of the last hit that read it (or its attach)
  std::int64_t hit_count = 0;    // hits that read it
  std::int64_t created = 0;      // tree clock tick it was attached at
  std::uint64_t dev_seq = 0;     // seq of its newest device-heap entry
  std::uint64_t host_seq = 0;    // seq of its newest host-heap entry
  std::uint32_t dev_children = 0;   // children holding this (window) component on the device
  std::uint32_t host_children = 0;  // ... in host memory

  const IndexRun& in(bool host_tier) const { return host_tier ? host : device; }
  IndexRun& in(bool host_tier) { return host_tier ? host : device; }
};

struct TreeNode {
  using ChildMap = std::unordered_map<PageKey, std::unique_ptr<TreeNode>, PageKeyHash>;

  TreeNode(std::int64_t id_, NodeHandle handle_, TreeNode* parent_, std::uint32_t ns_)
      : id(id_), handle(handle_), parent(parent_), ns(ns_) {}

  std::int64_t id;        // 0 for roots, like the Python tree
  NodeHandle handle;      // see common.h
  TreeNode* parent;       // nullptr for roots and for removed nodes
  std::uint32_t ns;       // index of the namespace (tree.h)
  // Children with a host copy: a host copy is a host-eviction candidate only
  // without them (hicache/tree/python/node.py TreeNode._host_children). The two host
  // counters sit in padding: the node is no larger for them.
  std::uint32_t num_host_children = 0;
  TokenRun tokens;        // a whole number of pages
  IndexRun device;        // one device page id per page, or undefined
  IndexRun host;          // one host page id per page, or undefined
  std::int64_t lock_ref = 0;       // running requests using the device pages
  std::int64_t host_lock_ref = 0;  // loads / third-tier writes reading the host pages
  IOStatus io_status = IOStatus::None;
  // Children whose host copy is busy: host-locked, IO in flight, or above a busy
  // host child. Host eviction can never take a busy host copy.
  std::uint32_t num_busy_host_children = 0;
  std::int64_t hit_count = 0;      // matches that went through this node
  std::int64_t last_access = 0;    // tree clock tick of the last match or insert touching it
  std::uint64_t dev_seq = 0;       // seq of this node's newest device-heap entry
  std::uint64_t host_seq = 0;      // seq of this node's newest host-heap entry
  std::uint32_t num_device_children = 0;  // children on the device (device-leaf test in O(1))
  bool exported = false;  // its handle reached Python: keep it readable after removal

  // Children are owned by the map and keyed by their first page; the sibling
  // links keep insertion order, which fixes the order of nodes() and hence the
  // seq order of rebuilt heaps (ties in priority are broken by seq).
  ChildMap children;
  TreeNode* first_child = nullptr;
  TreeNode* last_child = nullptr;
  TreeNode* prev_sibling = nullptr;
  TreeNode* next_sibling = nullptr;

  // Read only by some eviction policies: kept after the fields every match and
  // eviction touches.
  std::int64_t created = 0;   // tree clock tick of the insert that created it
  std::int64_t priority = 0;  // largest priority a match or insert gave it
  // One record per component of a hybrid tree (roots included); null in a
  // single-kind tree.
  std::unique_ptr<ComponentRecord[]> comps;

  bool on_device() const { return device.defined(); }
  bool on_host() const { return host.defined(); }
  bool is_root() const { return id == 0; }
  std::int64_t num_tokens() const { return static_cast<std::int64_t>(tokens.len); }
  PageKey first_page(std::size_t page_size) const { return {tokens.data, page_size}; }

  std::string repr() const {
    return "TreeNode(id=" + std::to_string(id) + ", tokens=" + std::to_string(tokens.len) +
           ", device=" + (on_device() ? "True" : "False") +
           ", host=" + (on_host() ? "True" : "False") + ", lock=" + std::to_string(lock_ref) +
           ", host_lock=" + std::to_string(host_lock_ref) + ", io=" + io_status_name(io_status) +
           ")";
  }
};

}  // namespace hicache
