// Page free list for one tier: the native twin of hicache/memory/allocator.py.
//
// A LIFO stack of free page ids over caller-owned arrays (the binding keeps
// them in tensors that Python also reads for integrity checks). Every check
// runs before any state changes, so a bad free throws and leaves the list as
// it was. Knows nothing of Python, tensors or what pages hold.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace hicache {

class FreeList {
 public:
  // free_stack and in_use have num_pages entries; the list starts with every
  // page free and page 0 on top.
  FreeList(std::string name, std::int64_t num_pages, page_id_t* free_stack, bool* in_use)
      : name_(std::move(name)), num_pages_(num_pages), stack_(free_stack), in_use_(in_use),
        stamp_(static_cast<std::size_t>(num_pages), 0) {
    for (std::int64_t i = 0; i < num_pages; ++i) {
      stack_[i] = num_pages - 1 - i;
      in_use_[i] = false;
    }
    num_free_ = num_pages;
  }

  std::int64_t num_free() const { return num_free_; }
  std::int64_t num_pages() const { return num_pages_; }

  // Write the n pages on top of the stack (top first) to out and mark them in
  // use; false (and nothing changes) when fewer than n are free.
  bool alloc(std::int64_t n, page_id_t* out) {
    if (n < 0) throw ValueError("num_pages: expected >= 0, got " + std::to_string(n));
    if (n > num_free_) return false;
    for (std::int64_t i = 0; i < n; ++i) {
      const page_id_t id = stack_[num_free_ - 1 - i];
      out[i] = id;
      in_use_[id] = true;
    }
    num_free_ -= n;
    return true;
  }

  // Return ids[0..n) to the list; ids[0] ends on top.
  void free(const page_id_t* ids, std::int64_t n) {
    if (n == 0) return;
    page_id_t lo = ids[0];
    page_id_t hi = ids[0];
    for (std::int64_t i = 1; i < n; ++i) {
      lo = std::min(lo, ids[i]);
      hi = std::max(hi, ids[i]);
    }
    if (lo < 0 || hi >= num_pages_) {
      throw ValueError(name_ + ": page ids must lie in [0, " + std::to_string(num_pages_) +
                       "), got range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    std::vector<page_id_t> bad;
    for (std::int64_t i = 0; i < n && bad.size() < 8; ++i) {
      if (!in_use_[ids[i]]) bad.push_back(ids[i]);
    }
    if (!bad.empty()) {
      std::string list = "[";
      for (std::size_t i = 0; i < bad.size(); ++i) {
        list += (i ? ", " : "") + std::to_string(bad[i]);
      }
      throw ValueError(name_ + ": double free or never allocated: pages " + list + "]");
    }
    if (++epoch_ == 0) {  // wrapped: old stamps could collide with the new epoch
      std::fill(stamp_.begin(), stamp_.end(), 0);
      epoch_ = 1;
    }
    for (std::int64_t i = 0; i < n; ++i) {
      std::uint32_t& s = stamp_[static_cast<std::size_t>(ids[i])];
      if (s == epoch_) throw ValueError(name_ + ": the same page id appears twice in one free");
      s = epoch_;
    }
    for (std::int64_t i = 0; i < n; ++i) {
      const page_id_t id = ids[n - 1 - i];
      in_use_[id] = false;
      stack_[num_free_ + i] = id;
    }
    num_free_ += n;
  }

 private:
  std::string name_;
  std::int64_t num_pages_;
  page_id_t* stack_;
  bool* in_use_;
  std::vector<std::uint32_t> stamp_;  // == epoch_: seen in the current free
  std::uint32_t epoch_ = 0;
  std::int64_t num_free_ = 0;
};

}  // namespace hicache
