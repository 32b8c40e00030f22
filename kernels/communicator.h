// Collectives among the ranks of one tensor-parallel group: the all-reduce
// after each row-parallel product (o_proj, down) and the gathers and
// broadcasts around them. One Communicator per rank; every rank of the
// group calls the same collectives in the same order on tensors of the
// same shape and dtype, each from its own thread.
//
// Contract: collectives are in place on `x`, a packed tensor in the rank's
// backend memory, and ordered like an op of the rank's backend: queued
// after every op issued on it so far and before every later one (on the
// CPU they run before the call returns; on a device they are queued on the
// rank's stream and the call returns without waiting for them). Every rank
// gets bit-identical results: sums add the ranks' values in rank order.
// A collective a rank never joins blocks the others: a rank that fails
// aborts the group (Abort) so that none waits for it, and the whole group
// goes down (engine/executor.h).
#pragma once

#include <memory>
#include <vector>

#include "kernels/tensor.h"

namespace pdserve::kernels {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // x = the sum over ranks of x (fp32).
  virtual void AllReduceSum(const Tensor& x) = 0;
  // x holds size() equal chunks of its flat elements; rank r's chunk r is
  // its input, and every rank leaves with every rank's chunk. numel() must
  // divide by size(). Any dtype.
  virtual void AllGather(const Tensor& x) = 0;
  // x = rank root's x. Any dtype.
  virtual void Broadcast(const Tensor& x, int root) = 0;
  // For a rank that failed: releases every rank of the group waiting in a
  // collective, now and later. Their collectives return at once, leaving x
  // undefined, and the group is of no use after; aborted() tells. Any
  // thread may call it, on any rank's communicator, any number of times.
  virtual void Abort() = 0;
  virtual bool aborted() const = 0;
  // True when a collective queued inside the body of the rank's
  // Backend::CaptureGraph becomes part of the graph: every replay runs it
  // again, on the same buffers, in order with the graph's other ops, and
  // no host step of it is left out of the graph. The ranks capture
  // together (a collective's host part, such as publishing buffer
  // addresses, runs at capture time and may wait for the other ranks) and
  // then replay their graphs of the same step together, as they run eager
  // collectives. False: a tensor-parallel group runs its steps eagerly.
  virtual bool capturable() const = 0;
};

// A group of `size` ranks that are threads of this process and share host
// memory (CPU ranks): one communicator per rank, index = rank. Each rank
// sums (or copies) its own 1/size of the elements straight from the other
// ranks' buffers, then copies the other ranks' results, with a barrier
// between the phases: no staging copy, and no rank does more than its share.
// Capturable: a CPU backend's graph keeps its body and runs it again on each
// replay (kernels/backend.h), so a collective in it runs again, barriers
// and all, like an eager one.
std::vector<std::unique_ptr<Communicator>> CreateSharedMemoryGroup(int size);

}  // namespace pdserve::kernels
