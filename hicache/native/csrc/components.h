// Components of a hybrid tree (hybrid models: docs/design.md, "Hybrid models:
// components"): what each kind answers, as hicache/tree/python/kind_window.py and
// kind_state.py do for the Python tree. A window component holds, per node and
// tier, its ids for all the node's pages or none; a state component the
// checkpoint at the node's end or none.
//
// Knows nothing of the tree: RadixTree keeps the records (node.h) and asks these
// hooks (components.cpp holds the tree's component operations).
#pragma once

#include <algorithm>
#include <cstdint>

namespace hicache {

struct ComponentKind {
  bool window = false;           // a sliding-window class, else a recurrent-state class
  std::int64_t width = 1;        // page ids per token page (window) or per checkpoint (state)
  std::int64_t window_pages = 0; // w: pages a hit reads before its first computed token

  // Page ids a node of num_pages pages holds when it holds this component.
  std::int64_t num_ids(std::int64_t num_pages) const { return window ? num_pages * width : width; }

  // Walking a path root side first: can a hit end at this node's end? `carry` is
  // the run of consecutive pages held, ending at the node before.
  bool serves(std::int64_t& carry, bool holds, std::int64_t num_pages,
              std::int64_t depth_pages) const {
    if (!window) {
      carry = 0;
      return holds;
    }
    carry = holds ? carry + num_pages : 0;
    return carry >= std::min(window_pages, depth_pages);
  }

  // The first page of [0, end) whose ids an insert keeps for a hit end at `end`:
  // the window's start, or the last page (a checkpoint at the end only).
  std::int64_t kept_from(std::int64_t end) const {
    return window ? std::max<std::int64_t>(0, end - window_pages) : end - 1;
  }

  // Whether the prefix a split cuts off a node holds it (given the node's).
  bool split_prefix_holds(bool holds) const { return window && holds; }

  // A hit at the end of a node this long also reads its parent's data.
  bool reads_parent(std::int64_t num_pages) const { return window && num_pages < window_pages; }
};

}  // namespace hicache
