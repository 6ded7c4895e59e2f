// Common types of the native radix tree: token and page ids, node handles, the
// IO status and eviction-policy enums, the error types the binding maps to
// Python's ValueError / TypeError, and the first-page key children are found by.
//
// Knows nothing of Python or of tensors.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

namespace hicache {

using token_t = std::int32_t;     // one token id, in [0, 2**31)
using page_id_t = std::int64_t;   // one device or host page id
using token_span = std::span<const token_t>;

// Integer handle of a node across the binding (never a raw pointer): the node id
// (>= 1) for non-root nodes, -(k + 1) for the root of the k-th namespace, and
// kNoNode for "no node" (the parent of a root). Ids are never reused, so a
// handle of a freed node stays invalid forever.
using NodeHandle = std::int64_t;
inline constexpr NodeHandle kNoNode = 0;

// Values match hicache.tree.IOStatus.
enum class IOStatus : std::uint8_t {
  None = 0,
  Loading = 1,    // host to device copy in flight
  BackingUp = 2,  // device to host copy in flight
};

inline const char* io_status_name(IOStatus s) {
  switch (s) {
    case IOStatus::None: return "NONE";
    case IOStatus::Loading: return "LOADING";
    case IOStatus::BackingUp: return "BACKING_UP";
  }
  return "?";
}

// Values and keys as in hicache/tree/policies.py (RadixTree::entry computes the keys).
enum class EvictionPolicy : std::uint8_t { LRU, LFU, FIFO, MRU, FILO, Priority, SLRU };

// SLRU: a node hit this many times leaves the probationary segment.
inline constexpr std::int64_t kSlruProtectedHits = 2;

// A caller's mistake; the binding raises ValueError.
struct ValueError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A caller passed the wrong kind of object; the binding raises TypeError.
struct TypeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A call the tree refuses in its current state: a tree-changing call from inside
// a hook (tree.h, RadixTree::check_reentry); the binding raises RuntimeError.
struct ReentryError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The largest token id; a valid id lies in [0, kMaxTokenId].
inline constexpr token_t kMaxTokenId = std::numeric_limits<token_t>::max();

// True if every id lies in [0, 2**31): none has the sign bit (one vectorized pass).
inline bool ids_valid(const token_t* data, std::size_t n) {
  std::uint32_t acc = 0;
  for (std::size_t i = 0; i < n; ++i) acc |= static_cast<std::uint32_t>(data[i]);
  return (acc >> 31) == 0;
}

// Raise ValueError unless every id lies in [0, 2**31) (the words of hicache.tree.token_key's
// range check, with the smallest id).
inline void check_ids(const token_t* data, std::size_t n) {
  if (!ids_valid(data, n)) {
    throw ValueError("tokens: expected ids in [0, " + std::to_string(kMaxTokenId) + "], got " +
                     std::to_string(*std::min_element(data, data + n)));
  }
}

// The largest page size (tokens per page) a tree takes: far above any real one,
// and small enough that every size computed from it (bytes of a page of int32
// tokens, pages times page size) stays far inside int64.
inline constexpr std::int64_t kMaxPageSize = std::int64_t{1} << 24;

// The first page of a child's run: the key its parent finds it by. The pointer
// is into the child's own token storage, which outlives the map entry.
struct PageKey {
  const token_t* data;
  std::size_t len;  // tokens (the page size)

  bool operator==(const PageKey& other) const {
    return len == other.len && std::equal(data, data + len, other.data);
  }
};

struct PageKeyHash {
  std::size_t operator()(const PageKey& k) const noexcept {
    return std::hash<std::string_view>{}(
        std::string_view(reinterpret_cast<const char*>(k.data), k.len * sizeof(token_t)));
  }
};

}  // namespace hicache
