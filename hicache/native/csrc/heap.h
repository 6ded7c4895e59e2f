// Eviction order: a lazy min-heap of candidate entries for one tier.
//
// An entry is (rank, priority, seq, node handle). Entries are never removed
// eagerly: a node whose priority changed, or that stopped being a candidate,
// just leaves a stale entry behind, which the tree skips when it pops it (the
// node's recorded seq, rank or priority no longer matches). seq is a per-heap
// push counter, so every key is distinct and pop order depends only on the set
// of entries, exactly as in hicache/tree/policies.py.
//
// Knows nothing of nodes or of what makes one a candidate (tree.cpp does).
#pragma once

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "common.h"

namespace hicache {

struct HeapEntry {
  std::int64_t rank;  // prefixes the priority (host tier: host-only leaves first)
  std::int64_t p1;    // the policy's key (RadixTree::entry), e.g. LRU: last_access
  std::int64_t p2;    // its tie-break, e.g. LFU: last_access (0 when the key has one part)
  std::uint64_t seq;
  NodeHandle node;

  auto key() const { return std::tie(rank, p1, p2, seq); }
};

class CandidateHeap {
 public:
  std::size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  std::uint64_t next_seq() { return ++seq_; }

  void push(const HeapEntry& e) {
    entries_.push_back(e);
    std::push_heap(entries_.begin(), entries_.end(), later);
  }

  // The smallest entry (the heap is not empty).
  const HeapEntry& top() const { return entries_.front(); }

  HeapEntry pop() {
    std::pop_heap(entries_.begin(), entries_.end(), later);
    HeapEntry e = entries_.back();
    entries_.pop_back();
    return e;
  }

  // Replace all entries (their seqs already drawn from next_seq()).
  void rebuild(std::vector<HeapEntry> entries) {
    entries_ = std::move(entries);
    std::make_heap(entries_.begin(), entries_.end(), later);
  }

  const std::vector<HeapEntry>& entries() const { return entries_; }
  std::size_t capacity_bytes() const { return entries_.capacity() * sizeof(HeapEntry); }

 private:
  // std heap functions build a max-heap for "less"; "later" makes it a min-heap.
  static bool later(const HeapEntry& a, const HeapEntry& b) { return a.key() > b.key(); }

  std::vector<HeapEntry> entries_;
  std::uint64_t seq_ = 0;
};

}  // namespace hicache
